"""Mixed precision: bf16 autocast for compute; parameters and optimizer state stay fp32."""

from __future__ import annotations

import contextlib

import torch

from kiln.config import PrecisionConfig


def autocast(cfg: PrecisionConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if cfg.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
