"""The job's process layout from the `parallel` config: sizes checked with clear errors.

Dimensions, outermost first: pp, dp_replicate, dp_shard, cp, tp (tensor parallel innermost,
so its heavy traffic stays between the closest ranks, e.g. the GPUs of one node).

No torch here: the CLI checks a layout before it starts processes or imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    ep: int = 1
    """Expert-parallel ranks: a split of dp_shard (consecutive ranks), not a mesh dimension."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each reads its own slice of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in DIMS)

    def __str__(self) -> str:
        used = [f"{d}={getattr(self, d)}" for d in (*DIMS, "ep") if getattr(self, d) > 1]
        return " x ".join(used) or "one process"


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
    layout = Layout(pcfg.pp, pcfg.dp_replicate, dp_shard, pcfg.cp, pcfg.tp, pcfg.ep)
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
    if layout.ep > 1:
        check_expert_parallel(layout, model)
    if layout.cp > 1:
        if device_type != "cuda":
            raise KilnError(f"parallel.cp={layout.cp}: context parallel (ring attention) runs only "
                            "on CUDA GPUs; PyTorch's CPU attention kernel has no sharding rule for "
                            "it. Use cp: 1 on this device")
        if seq_len % (2 * layout.cp):
            raise KilnError(f"parallel.cp={layout.cp}: data.seq_len={seq_len} must be divisible "
                            f"by 2 x cp (load-balanced ring attention)")
    return layout


def check_expert_parallel(layout: Layout, model: ModelConfig) -> None:
    """parallel.ep > 1: experts to split, evenly, over ranks taken from dp_shard."""
    ep = layout.ep
    if model.moe is None:
        raise KilnError(f"parallel.ep={ep}: expert parallelism splits the experts of a mixture "
                        "of experts, but the model has none (model.moe is not set); use ep: 1")
    if layout.dp_shard % ep:
        raise KilnError(f"parallel.ep={ep} must divide the data-parallel shard ranks "
                        f"(dp_shard={layout.dp_shard} in the layout {layout}): the expert-parallel "
                        "ranks are taken from them")
    if model.moe.n_experts % ep:
        raise KilnError(f"parallel.ep={ep} must divide model.moe.n_experts="
                        f"{model.moe.n_experts}: each expert-parallel rank holds an equal block "
                        "of every MoE layer's experts")
    for name in ("pp", "cp"):
        if getattr(layout, name) > 1:
            raise KilnError(f"parallel.ep={ep} with parallel.{name}={getattr(layout, name)}: "
                            f"expert parallelism does not combine with {name} yet; use "
                            f"{name}: 1 (or ep: 1)")


def device_type(name: str) -> str:
    """The device type train.device names ('cpu', 'cuda', ...); 'auto' asks torch (the one case
    that imports it)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name.split(":")[0]


def check_layout(cfg, world_size: int) -> tuple[Layout, str]:
    """The job's layout on world_size processes and its device type, or a KilnError (also for a
    tuning method that cannot run on that layout)."""
    from kiln.peft import check_layout as check_tuning  # torch-heavy: only when a job is checked

    kind = device_type(cfg.train.device)
    layout = resolve_layout(cfg.parallel, world_size, cfg.model, cfg.data.seq_len, kind)
    check_tuning(cfg, layout)
    return layout, kind
