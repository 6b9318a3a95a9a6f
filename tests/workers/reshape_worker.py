"""Run by tests/test_reshape.py under `torchrun --nproc-per-node 2`; writes its findings as JSON.

Three checks on two real gloo ranks:
- tensor parallel: the plan (sequence parallel included) on a model gives the unsharded
  logits and gradients;
- FSDP2: between forward and backward no unsharded weight copy is alive;
- global token count: two data-parallel ranks with unequal label masks make the same update as
  one process over both halves.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kiln.config import JobConfig, ModelConfig, ParallelConfig
from kiln.data.batch import Batch
from kiln.models.transformer import Transformer
from kiln.parallel.dtensor import full_tensor
from kiln.parallel.parallelize import apply_fsdp
from kiln.parallel.tensor_parallel import apply_tensor_parallel
from kiln.tasks.pretrain import Pretrain
from kiln.train.trainer import train_step

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
CFG = ModelConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=160, max_seq_len=64)
out = {}


def model(seed=0) -> Transformer:
    m = Transformer(CFG)
    m.init_weights(seed)
    return m


# 1. Tensor parallel (with sequence parallel between the blocks) on a whole model; 15 tokens,
# an odd length that sequence parallel pads and cuts back.
def tensor_parallel() -> None:
    reference, tp_model = model(), model()
    x = torch.randint(0, CFG.vocab_size, (2, 15), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, 15, CFG.vocab_size, generator=torch.Generator().manual_seed(2))
    expected = reference(x)
    (expected * probe).sum().backward()
    apply_tensor_parallel(tp_model, init_device_mesh("cpu", (2,)))
    got = tp_model(x)
    (got * probe).sum().backward()
    out["tp_max_diff"] = (got - expected).abs().max().item()
    out["tp_sharded"] = all(type(p).__name__ == "DTensor" for n, p in tp_model.named_parameters()
                            if n.endswith(("q.weight", "down.weight")))
    out["tp_grad_max_diff"] = max(
        (full_tensor(p.grad) - q.grad).abs().max().item()
        for p, q in zip(tp_model.parameters(), reference.parameters()))


# 2. FSDP2: what autograd keeps for backward holds no unsharded weight.
def fsdp_keeps_no_unsharded_weight() -> None:
    dp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    job = JobConfig(parallel=ParallelConfig())
    sharded = model()
    apply_fsdp(sharded, dp_mesh, job)
    weight_shapes = {tuple(p.shape) for n, p in model().named_parameters() if p.ndim == 2 and "layers" in n}
    weight_shapes |= {(a[0] + b[0] + c[0], a[1]) for a, b, c in [((64, 64), (32, 64), (32, 64))]}  # q|k|v
    weight_shapes |= {(2 * 160, 64)}  # gate|up
    saved = []
    tokens = torch.randint(0, CFG.vocab_size, (3, 16), generator=torch.Generator().manual_seed(rank))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        loss = Pretrain().loss_sum(sharded, Batch(tokens, torch.roll(tokens, -1, 1)))
    live = lambda t: t.untyped_storage().nbytes()  # noqa: E731 (freed storages have 0 bytes)
    weights_alive = [tuple(t.shape) for t in saved if tuple(t.shape) in weight_shapes and live(t)]
    out["fsdp_weight_copies_alive"] = weights_alive
    out["fsdp_saved_bytes"] = sum(live(t) for t in {id(t.untyped_storage()): t for t in saved}.values())
    loss.backward()


# 3. Global token count: unequal masks on two data-parallel ranks == one process.
def global_token_count() -> None:
    torch.manual_seed(0)
    all_tokens = torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(5))
    labels = all_tokens[:, 1:].clone()
    labels[0, :12] = -100  # rank 0's half loses most of a row; rank 1's keeps everything
    labels[1, 3:9] = -100
    batches = [Batch(all_tokens[:, :-1], labels)]
    single = model()
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    single_loss, _ = train_step(single, opt, Pretrain().loss_sum, batches)
    dp = model()
    apply_fsdp(dp, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_replicate", "dp_shard")),
               JobConfig(parallel=ParallelConfig()))
    mine = slice(2 * rank, 2 * rank + 2)
    opt = torch.optim.SGD(dp.parameters(), lr=0.5)
    dp_loss, _ = train_step(dp, opt, Pretrain().loss_sum,
                            [Batch(all_tokens[mine, :-1], labels[mine])], dp_group=dist.group.WORLD)
    dist.all_reduce(dp_loss)
    out["dp_loss"], out["single_loss"] = dp_loss.item(), single_loss.item()
    full = {n: full_tensor(p.detach()) for n, p in dp.named_parameters()}
    out["dp_weight_max_diff"] = max((full[n] - p).abs().max().item() for n, p in single.named_parameters())
    out["dp_changed"] = (full["layers.0.attn.q.weight"] - model().layers["0"].attn.q.weight).abs().max().item()


# Each check in a function: what it built (DTensors, autograd graphs that hold the process
# group) is freed before the group is destroyed, not at interpreter exit, where it can abort.
for check in (tensor_parallel, fsdp_keeps_no_unsharded_weight, global_token_count):
    check()
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
