"""AdamW with weight decay on matrices only (not norms, biases or embeddings)."""

from __future__ import annotations

import torch
from torch import nn

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
    # fused kernels exist for CUDA and CPU; foreach elsewhere (e.g. DTensor params).
    device = next(model.parameters()).device.type
    fused = device in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, fused=fused, foreach=None if fused else True)
