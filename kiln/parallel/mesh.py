"""The job's DeviceMesh, built from its Layout (kiln.launch.layout, re-exported here)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.errors import KilnError
from kiln.launch.layout import DIMS, Layout, resolve_layout

__all__ = ["DIMS", "Layout", "resolve_layout", "build_mesh", "dp_mesh", "dp_group",
           "dp_rank_size", "device_for_rank", "rank_world", "ExpertMeshes", "expert_meshes"]


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """One DeviceMesh over every dimension (size-1 ones too, so code can always name them),
    plus the flattened "dp" dimension the data and the loss are split over; None in one process."""
    if layout.world_size == 1:
        return None
    mesh = init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS), mesh_dim_names=DIMS)
    dp_mesh(mesh)
    if layout.ep > 1:
        # The same ranks with dp_shard split into (efsdp, ep), ep innermost (torchtitan's
        # sparse mesh): an unflattened view shares the root's ranks, so FSDP2 can shard the
        # experts' ep-sharded DTensors over efsdp. Made once here (each call makes new groups)
        # and kept on the root mesh, which has no place of its own for a second view.
        if not hasattr(mesh, "_unflatten"):  # added to DeviceMesh in torch 2.10
            raise KilnError(f"parallel.ep={layout.ep} needs DeviceMesh._unflatten, which torch "
                            f"{torch.__version__} lacks; use torch 2.10 or later")
        full = mesh._unflatten("dp_shard", (layout.dp_shard // layout.ep, layout.ep), ("efsdp", "ep"))
        mesh._kiln_experts = ExpertMeshes(full["ep"], full["dp_replicate", "efsdp"])
    return mesh


@dataclass(frozen=True)
class ExpertMeshes:
    ep: DeviceMesh
    """The ranks one MoE layer's experts are split over (a block each)."""
    dp: DeviceMesh
    """(dp_replicate, efsdp): the data-parallel ranks that hold the same block of experts;
    FSDP2 shards the experts over them (size 1: dp == ep, the experts stay plain)."""


def expert_meshes(mesh: DeviceMesh | None) -> ExpertMeshes | None:
    """The expert-parallel views of the job's mesh, or None without expert parallelism."""
    return getattr(mesh, "_kiln_experts", None)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The flattened (dp_replicate x dp_shard) dimension. `_flatten` returns the same mesh on
    every call; slicing "dp" from the root mesh instead is deprecated."""
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")


def dp_group(mesh: DeviceMesh | None):
    """The process group of this rank's data-parallel peers, or None in one process."""
    return None if mesh is None else dp_mesh(mesh).get_group()


def dp_rank_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    if mesh is None:
        return 0, 1
    dp = dp_mesh(mesh)
    return dp.get_local_rank(), dp.size()


def device_for_rank(device_type: str) -> torch.device:
    """This process's device: cuda:LOCAL_RANK under a launcher, the CPU otherwise."""
    if device_type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device_type)
