"""Run by tests/test_expert_parallel.py under `torchrun --nproc-per-node 2`; writes its findings
as JSON (one file per rank: RESULT.rank<r>).

On two real gloo ranks, 4 experts, 2 on each rank:
- permutation: rows tagged (rank, row), most sent to the other rank's experts, arrive grouped by
  expert and come back, through identity experts, to their own positions;
- a MoE layer whose experts are replaced by ExpertParallel gives the outputs and gradients of the
  whole layer in one process (expert weights: their gradients summed over the ranks' tokens).
"""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kiln.config import ModelConfig
from kiln.models.moe import MoE
from kiln.parallel.expert import ExpertParallel, combine, dispatch


def main():
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    out = {}

    # -- the permutation alone ------------------------------------------------------------------
    # Rows per global expert on each rank (rank 0 holds experts 0 and 1, rank 1 experts 2 and 3),
    # sorted by expert as the MoE sorts them: most rows go to the other rank's experts. A row's tag
    # is (its rank, its row).
    COUNTS = {0: [1, 2, 2, 3], 1: [2, 3, 1, 2]}
    n_experts, local = 4, 2
    other = 1 - rank
    counts = torch.tensor(COUNTS[rank])
    tags = torch.tensor([[rank, row] for row in range(int(counts.sum()))], dtype=torch.float32)
    d = dispatch(tags, counts, group)
    out["counts"] = COUNTS
    out["arrived"] = d.rows.tolist()
    out["arrived_counts"] = d.counts.tolist()
    out["returned"] = combine(d.rows, d, group).tolist()
    out["tags"] = tags.tolist()

    # -- a MoE layer with expert parallel ---------------------------------------------------------
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, intermediate_size=64,
                      moe=dict(n_experts=4, top_k=2, intermediate_size=16, n_shared_experts=1))
    torch.manual_seed(0)  # the same layer on both ranks
    whole = MoE(cfg).train()
    torch.nn.init.normal_(whole.router.weight, std=0.5)
    parallel = copy.deepcopy(whole)
    parallel.experts = ExpertParallel(whole.experts, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(10 + rank))  # own tokens
    weights = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(20 + rank))
    results = []
    for layer in (whole, parallel):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * weights).sum().backward()
        results.append((y, xi.grad))
    out["y_max_diff"] = (results[0][0] - results[1][0]).abs().max().item()
    out["x_grad_max_diff"] = (results[0][1] - results[1][1]).abs().max().item()
    out["router_grad_max_diff"] = (whole.router.weight.grad - parallel.router.weight.grad).abs().max().item()
    block = slice(rank * local, (rank + 1) * local)
    diffs = []
    for name in ("gate", "up", "down"):
        summed = getattr(whole.experts, name).grad.clone()
        dist.all_reduce(summed, group=group)  # the whole layer trained on both ranks' tokens
        diffs.append((summed[block] - getattr(parallel.experts, name).grad.to_local()).abs().max().item())
    out["expert_grad_max_diff"] = max(diffs)
    out["tokens_routed_off_rank"] = int(whole.stats.counts[[other * local, other * local + 1]].sum())

    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(out, f)


# The work in a function: what it built (DTensors, autograd graphs that hold the process group)
# is freed before the group is destroyed, not at interpreter exit, where gloo can abort (1 run in 10).
dist.init_process_group("gloo")
main()
dist.destroy_process_group()
