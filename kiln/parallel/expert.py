"""Expert parallelism: each rank of a group holds a contiguous block of a layer's experts, and
routed tokens travel to the rank of their expert and back, with two all-to-alls.

ExpertParallel takes the place of a MoE layer's `experts` (same forward: rows sorted by expert,
tokens per expert; same parameter names), so the router, the gate weights and the scatter back
to token positions stay where they are. The all-to-alls are autograd functions: backward sends the gradients
the opposite way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.nn.functional import all_to_all_single
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln.models.moe import Experts, moe_layers


@dataclass
class Dispatched:
    """What arrived at this rank, and what combine needs to send the outputs back."""

    rows: torch.Tensor
    """The rows for this rank's experts, grouped by local expert (then by source rank)."""
    counts: torch.Tensor
    """(local experts,) rows per local expert."""
    order: torch.Tensor
    """rows[i] is row order[i] of what the all-to-all delivered (grouped by source rank)."""
    sent: list[int]
    """Rows this rank sent to each rank."""
    received: list[int]
    """Rows this rank received from each rank."""


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> Dispatched:
    """Send the rows of `x` (sorted by global expert, counts[e] rows for expert e) to the ranks
    that hold their experts: rank r holds experts r * n/ep ... (r + 1) * n/ep - 1."""
    ep = dist.get_world_size(group)
    local = counts.numel() // ep
    # Each rank learns how many rows it gets for each of its experts from each rank.
    incoming = torch.empty_like(counts)
    dist.all_to_all_single(incoming, counts, group=group)
    incoming = incoming.view(ep, local)  # (source rank, local expert)
    # The split sizes must be known on the host: one sync per layer, as in every dropless EP.
    sent = counts.view(ep, local).sum(1).tolist()
    received = incoming.sum(1).tolist()
    out = x.new_empty(sum(received), x.shape[1])
    delivered = all_to_all_single(out, x.contiguous(), received, sent, group=group)
    # Delivered blocks are (source, expert) in source-major order; the experts want them
    # expert-major. order[p] = where output row p sits in the delivered rows.
    sizes = incoming.flatten()
    starts = (sizes.cumsum(0) - sizes).view(ep, local).T.flatten()
    sizes_t = incoming.T.flatten()
    out_starts = sizes_t.cumsum(0) - sizes_t
    total = int(sizes.sum())
    order = torch.arange(total, device=x.device) + torch.repeat_interleave(
        starts - out_starts, sizes_t, output_size=total)
    return Dispatched(delivered[order], incoming.sum(0), order, sent, received)


def combine(y: torch.Tensor, d: Dispatched, group: dist.ProcessGroup) -> torch.Tensor:
    """The experts' outputs for `d.rows`, back on the ranks and in the rows they came from."""
    delivered_order = torch.empty_like(d.order)
    delivered_order[d.order] = torch.arange(d.order.numel(), device=d.order.device)
    back = y[delivered_order]  # source-major again, as the rows arrived
    out = y.new_empty(sum(d.sent), y.shape[1])
    return all_to_all_single(out, back.contiguous(), d.sent, d.received, group=group)


class ExpertParallel(Experts):
    """A layer's experts split over an expert-parallel mesh: each rank computes a contiguous
    block of them (rank r: experts r * n/ep ... (r + 1) * n/ep - 1).

    The weights keep their names and global shapes, as DTensors sharded on dimension 0 over
    the mesh: checkpoints (DCP) hold every expert once under its global name and reshard to
    any layout, gradient norms count each expert once, and FSDP2 can shard the blocks further
    over the data-parallel ranks that hold the same block.
    """

    def __init__(self, experts: Experts, mesh: DeviceMesh):
        nn.Module.__init__(self)
        n = experts.down.shape[0]
        if n % mesh.size():
            raise ValueError(f"{n} experts cannot be split evenly over {mesh.size()} expert-parallel ranks")
        self.compute, self.mesh = experts.compute, mesh
        for name in ("gate", "up", "down"):
            # Each rank cuts its own block (no communication; on the meta device, no memory).
            block = distribute_tensor(getattr(experts, name).detach(), mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(block))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group = self.mesh.get_group()
        d = dispatch(x, counts, group)
        # The block's own weights (FSDP2, when it shards them further, has gathered them).
        gate, up, down = (w.to_local() if isinstance(w, DTensor) else w
                          for w in (self.gate, self.up, self.down))
        return combine(self.swiglu(d.rows, d.counts, gate, up, down), d, group)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[ExpertParallel]:
    """Every MoE layer's experts in place split over `mesh`; the new modules."""
    split = []
    for moe in moe_layers(model).values():
        moe.experts = ExpertParallel(moe.experts, mesh)
        split.append(moe.experts)
    return split
