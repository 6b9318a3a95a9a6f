"""Expert parallelism: each rank of a group holds a contiguous block of a layer's experts, and
routed tokens travel to the rank of their expert and back, with two all-to-alls.

ExpertParallel takes the place of a MoE layer's `experts` (same forward: rows sorted by expert,
tokens per expert), so the router, the gate weights and the scatter back to token positions
stay where they are. The all-to-alls are autograd functions: backward sends the gradients
the opposite way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

from kiln.models.moe import Experts


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


class ExpertParallel(nn.Module):
    """This rank's block of a layer's experts, in the place of the whole Experts module."""

    def __init__(self, local: Experts, group: dist.ProcessGroup):
        super().__init__()
        self.local = local
        self.group = group

    @classmethod
    @torch.no_grad()
    def shard(cls, experts: Experts, group: dist.ProcessGroup) -> ExpertParallel:
        """Keep this rank's contiguous block of `experts` (their weights copied)."""
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        n, dim, hidden = experts.down.shape
        if n % ep:
            raise ValueError(f"{n} experts cannot be split evenly over {ep} expert-parallel ranks")
        block = slice(rank * n // ep, (rank + 1) * n // ep)
        local = Experts(n // ep, dim, hidden)
        for name in ("gate", "up", "down"):
            getattr(local, name).copy_(getattr(experts, name)[block])
        local.compute = experts.compute
        return cls(local.to(experts.down.device), group)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        d = dispatch(x, counts, self.group)
        return combine(self.local(d.rows, d.counts), d, self.group)
