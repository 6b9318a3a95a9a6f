"""AdamW with weight decay on matrices only (not norms, biases or embeddings)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float, lr: float | None = None,
                 lora_b_lr_ratio: float = 1.0) -> list[dict]:
    """AdamW's groups: decay or not, and with LoRA+ (lora_b_lr_ratio > 1) the adapters' B
    matrices at lr times the ratio."""
    kinds: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_embedding = name.split(".")[-2:-1] == ["embed"]
        decay_rate = 0.0 if p.ndim < 2 or is_embedding else weight_decay
        ratio = lora_b_lr_ratio if name.endswith("lora_B.weight") else 1.0
        kinds.setdefault((decay_rate, ratio), []).append(p)
    groups = []
    for (decay_rate, ratio), params in kinds.items():
        # One group per mesh (plain tensors, tensor-parallel blocks, FSDP-only parts): a
        # foreach kernel takes tensors of one kind. Checkpoints map state by name, not group;
        # no empty groups (a flattened optimizer state cannot name one).
        by_mesh: dict = {}
        for p in params:
            by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
        extra = {} if ratio == 1.0 else {"lr": lr * ratio}
        groups += [{"params": ps, "weight_decay": decay_rate, **extra} for ps in by_mesh.values()]
    return groups


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    lora_b_lr_ratio: float = 1.0) -> torch.optim.Optimizer:
    # fused kernels exist for CUDA and CPU tensors; foreach for DTensors (sharded parameters).
    params = [p for p in model.parameters() if p.requires_grad]
    fused = params[0].device.type in ("cuda", "cpu") and not any(isinstance(p, DTensor) for p in params)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, cfg.lr, lora_b_lr_ratio), lr=cfg.lr,
                             betas=cfg.betas, eps=cfg.eps, fused=fused, foreach=None if fused else True)
