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
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    # fused kernels exist for CUDA and CPU tensors; foreach for DTensors (sharded parameters).
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu") and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, fused=fused, foreach=None if fused else True)
