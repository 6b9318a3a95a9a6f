"""The job's process layout: sizes from the `parallel` config, checked, and one DeviceMesh.

Dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (tensor parallel innermost,
so its heavy traffic stays between the closest ranks, e.g. the GPUs of one node).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.config import ModelConfig, ParallelConfig
from kiln.errors import KilnError

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own slice of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in DIMS)

    def __str__(self) -> str:
        used = [f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) > 1]
        return " x ".join(used) or "one process"


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_layout(pcfg: ParallelConfig, world_size: int, model: ModelConfig,
                   seq_len: int, device_type: str) -> Layout:
    """Sizes for every dimension, or a KilnError that says which size does not fit and why."""
    others = pcfg.dp_replicate * pcfg.tp * pcfg.pp * pcfg.cp
    dp_shard = pcfg.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise KilnError(f"parallel: dp_replicate x tp x pp x cp = {others} does not divide "
                            f"the world size {world_size} (the number of processes)")
        dp_shard = world_size // others
    layout = Layout(pcfg.pp, pcfg.dp_replicate, dp_shard, pcfg.cp, pcfg.tp)
    if layout.world_size != world_size:
        raise KilnError(f"parallel: the layout {layout} needs {layout.world_size} processes, but "
                        f"the job has {world_size}; the product of dp_replicate, dp_shard, tp, pp "
                        "and cp must equal the world size (dp_shard: -1 takes what is left)")
    if model.n_heads % layout.tp or model.kv_heads % layout.tp:
        raise KilnError(f"parallel.tp={layout.tp} must divide model.n_heads={model.n_heads} and "
                        f"the key/value heads ({model.kv_heads}): each rank takes whole heads")
    if model.intermediate_size % layout.tp:
        raise KilnError(f"parallel.tp={layout.tp} must divide model.intermediate_size="
                        f"{model.intermediate_size}")
    stages = layout.pp * pcfg.pp_stages_per_rank
    if stages > model.n_layers:
        raise KilnError(f"parallel: {stages} pipeline stages (pp={layout.pp} x "
                        f"pp_stages_per_rank={pcfg.pp_stages_per_rank}) but the model has only "
                        f"{model.n_layers} layers: each stage needs at least one")
    if layout.pp > 1 and model.tie_embeddings:
        raise KilnError("parallel.pp > 1 with model.tie_embeddings: the embedding (first stage) "
                        "and the output projection (last stage) cannot share a weight across stages")
    if layout.cp > 1:
        if device_type != "cuda":
            raise KilnError(f"parallel.cp={layout.cp}: context parallel (ring attention) runs only "
                            "on CUDA GPUs; PyTorch's CPU attention kernel has no sharding rule for "
                            "it. Use cp: 1 on this device")
        if seq_len % (2 * layout.cp):
            raise KilnError(f"parallel.cp={layout.cp}: data.seq_len={seq_len} must be divisible "
                            f"by 2 x cp (load-balanced ring attention)")
    return layout


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """One DeviceMesh over every dimension (size-1 ones too, so code can always name them),
    plus the flattened "dp" dimension the data and the loss are split over; None in one process."""
    if layout.world_size == 1:
        return None
    mesh = init_device_mesh(device_type, tuple(getattr(layout, d) for d in DIMS), mesh_dim_names=DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def dp_group(mesh: DeviceMesh | None):
    """The process group of this rank's data-parallel peers, or None in one process."""
    return None if mesh is None else mesh["dp"].get_group()


def dp_rank_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    if mesh is None:
        return 0, 1
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def device_for_rank(device_type: str) -> torch.device:
    """This process's device: cuda:LOCAL_RANK under a launcher, the CPU otherwise."""
    if device_type == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(device_type)
