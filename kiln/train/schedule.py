"""Learning-rate schedules as a multiplier of optim.lr per step."""

from __future__ import annotations

import math
from collections.abc import Callable

from kiln.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, total_steps: int) -> Callable[[int], float]:
    """warmup (linear from ~0) then cosine to min_lr_ratio, wsd (flat, then linear decay in the
    last decay_fraction of steps) or constant."""
    warmup, floor = cfg.warmup_steps, cfg.min_lr_ratio

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.kind == "constant":
            return 1.0
        if cfg.kind == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        decay_start = total_steps - int(cfg.decay_fraction * total_steps)
        if step < max(decay_start, warmup):
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - floor) * progress

    return multiplier
