"""Small helpers for parameters that may be DTensors (sharded by FSDP2 or tensor parallel)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) tensor into a parameter: all of it, or this rank's slice of it.

    Every rank holds the same `full` (made from the same seed or read from the same file), so
    each cuts its own slice locally, with no communication. An NF4 parameter (QLoRA's base)
    gets `full` quantised whole, then sliced (kiln.peft.qlora.load_whole).
    """
    from kiln.peft.qlora import is_nf4, load_whole

    # The DTensor's own local tensor: to_local() of a Parameter is a view (torch >= 2.13), and
    # an NF4Tensor is loaded by swapping its inner tensors, which must happen on the real one.
    local = param._local_tensor if isinstance(param, DTensor) else param
    if is_nf4(local):
        load_whole(local, full, *_dim0_chunk(param))
    elif isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def _dim0_chunk(param: torch.Tensor) -> tuple[int, int]:
    """(index, count): this rank holds row chunk `index` of `count` of the whole tensor."""
    index, count = 0, 1
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                if placement.dim != 0:
                    raise AssertionError(f"an NF4 weight sharded on dim {placement.dim}, not 0")
                size = param.device_mesh.size(dim)
                index, count = index * size + param.device_mesh.get_local_rank(dim), count * size
    return index, count


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank when it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
