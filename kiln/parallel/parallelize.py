"""parallelize(model, mesh, cfg): tensor parallel, activation checkpointing, compile, FSDP2.

The order matters: tensor parallel first (it replaces parameters with DTensors over the tp
dimension), checkpointing and compile per block, then FSDP2 shards what is there over the
data-parallel dimensions. Every step keeps the parameters' names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from kiln.config import JobConfig
from kiln.parallel.mesh import dp_mesh
from kiln.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, mesh: DeviceMesh | None, cfg: JobConfig) -> nn.Module:
    """Apply the job's layout and wrappers to `model` in place (on any device, meta too)."""
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    for block in model.layers.values():
        if cfg.train.activation_checkpointing:
            # Recompute this block's activations in backward instead of keeping them.
            checkpoint(block)
        if cfg.train.compile:
            block.compile()
    if mesh is not None and dp_mesh(mesh).size() > 1:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], cfg)
    return model


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, cfg: JobConfig) -> None:
    """FSDP2 per block and at the root, over (dp_replicate, dp_shard): HSDP when both are > 1,
    plain data parallel when dp_shard is 1, fully sharded when dp_replicate is 1."""
    pcfg = cfg.parallel
    param_dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if pcfg.cpu_offload else None
    kwargs = dict(mesh=dp_mesh, mp_policy=mp, **({"offload_policy": offload} if offload else {}))
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=pcfg.reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    # Gradients are summed, not averaged, over ranks: the loss is already divided by the
    # global count of targets, so the sum is the gradient of one big batch.
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM: the factor-1 divide would otherwise be NCCL's PREMUL_SUM, which
            # gloo lacks; with a factor of 1 there is nothing to pre- or post-scale.
            module.set_force_sum_reduction_for_comms(True)
