"""AdamW with weight decay on matrices only (not norms, biases or embeddings)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.split(".")[-2:-1] == ["embed"]
        (no_decay if p.ndim < 2 or is_embedding else decay).append(p)
    groups = []
    for params, decay_rate in ((decay, weight_decay), (no_decay, 0.0)):
        # One group per mesh (plain tensors, tensor-parallel blocks, FSDP-only parts): a
        # foreach kernel takes tensors of one kind. Checkpoints map state by name, not group;
        # no empty groups (a flattened optimizer state cannot name one).
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        groups += [{"params": ps, "weight_decay": decay_rate} for ps in by_mesh.values()]
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    # fused kernels exist for CUDA and CPU tensors; foreach for DTensors (sharded parameters).
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu") and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, fused=fused, foreach=None if fused else True)
