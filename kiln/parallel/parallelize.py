"""parallelize(model, mesh, cfg): tensor or expert parallel, activation checkpointing, compile,
FSDP2.

The order matters: activation checkpointing first (its recompute replays each block from the
input it was given), tensor and expert parallel (they replace parameters with DTensors over
the tp or ep ranks), compile per block, then FSDP2 shards what is there over
the data-parallel dimensions. Every step keeps the parameters' names.

Gradients under expert parallelism: every rank's loss is its own tokens' loss sum over the
global target count, and FSDP2 sums (not averages) gradients over the data-parallel ranks, so
the sum over ranks is the gradient of the whole batch. An expert's block lives on one rank of
each ep group; the all-to-all's backward brings it the gradients of every token of the group
routed to it, already summed over the group's ranks. What is left is the sum over the ep
groups: FSDP2 over (dp_replicate, efsdp), the ranks holding the same block, with the same plain
sum; nothing when dp == ep. No rescaling anywhere.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from kiln.config import JobConfig
from kiln.models.moe import moe_layers
from kiln.parallel.expert import ExpertParallel, apply_expert_parallel
from kiln.parallel.mesh import ExpertMeshes, dp_mesh, expert_meshes
from kiln.parallel.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, mesh: DeviceMesh | None, cfg: JobConfig) -> nn.Module:
    """Apply the job's layout and wrappers to `model` in place (on any device, meta too)."""
    if cfg.train.activation_checkpointing:
        # Recompute each block's activations in backward instead of keeping them. First: its
        # hook must see the block's input before tensor parallel's entry hook (on a region's
        # first block) slices it, since the recompute calls the block, hooks and all, again.
        for block in model.layers.values():
            checkpoint(block)
    if mesh is not None and mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if (experts := expert_meshes(mesh)) is not None:
        apply_expert_parallel(model, experts.ep)
    if mesh is not None and dp_mesh(mesh).size() > 1:
        # Load balance is measured over the step's micro-batch on all data-parallel ranks
        # together, as one process running that micro-batch would (kiln.train.loss.aux_loss_sum).
        for moe in moe_layers(model).values():
            moe.balance_group = dp_mesh(mesh).get_group()
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    if mesh is not None and dp_mesh(mesh).size() > 1:
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"], cfg, expert_meshes(mesh))
    return model


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, cfg: JobConfig,
               experts: ExpertMeshes | None = None) -> None:
    """FSDP2 per block and at the root, over (dp_replicate, dp_shard): HSDP when both are > 1,
    plain data parallel when dp_shard is 1, fully sharded when dp_replicate is 1. Expert-parallel
    blocks over experts.dp, the ranks that hold the same block."""
    pcfg = cfg.parallel
    param_dtype = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision.dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if pcfg.cpu_offload else None
    kwargs = dict(mp_policy=mp, **({"offload_policy": offload} if offload else {}))
    # Expert-parallel blocks: sharded further over the ranks that hold the same block, on
    # dimension 1 (dimension 0 is already split over ep); kept whole when no rank shares them.
    ignored: set[nn.Parameter] = set()
    for module in (m for m in model.modules() if isinstance(m, ExpertParallel)):
        if experts.dp.size() > 1:
            fully_shard(module, mesh=experts.dp, reshard_after_forward=pcfg.reshard_after_forward,
                        shard_placement_fn=lambda _: Shard(1), **kwargs)
        else:
            ignored.update(module.parameters())
    kwargs.update(mesh=dp_mesh, **({"ignored_params": ignored} if ignored else {}))
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
