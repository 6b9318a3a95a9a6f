"""Applied to a plain model from outside: activation checkpointing, then compile (later: TP, FSDP)."""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from kiln.config import TrainConfig


def parallelize(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Wrap each transformer block in place; parameter names do not change."""
    for block in model.blocks:
        if cfg.activation_checkpointing:
            # Recompute this block's activations in backward instead of keeping them.
            checkpoint(block)
        if cfg.compile:
            block.compile()
    return model
