"""Small helpers for parameters that may be DTensors (sharded by FSDP2 or tensor parallel)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) tensor into a parameter: all of it, or this rank's slice of it.

    Every rank holds the same `full` (made from the same seed or read from the same file), so
    each cuts its own slice locally, with no communication.
    """
    if isinstance(param, DTensor):
        local = distribute_tensor(full.to(param.device, param.dtype), param.device_mesh,
                                  param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank when it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
