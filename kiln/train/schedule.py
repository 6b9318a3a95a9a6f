"""Learning-rate schedules: warmup then cosine, warmup-stable-decay, or constant."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

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


class LRSchedule:
    """Sets every parameter group's LR to peak_lr x multiplier(step) x the group's scale: its
    LR when the optimizer was built over peak_lr (1, or LoRA+'s ratio for the B matrices).

    Its state is the step alone: the peak LR and the shape of the schedule come from the run's
    config, so a resumed run with a changed optim.lr or max_steps follows the new schedule from
    the step it resumed at.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, cfg: ScheduleConfig,
                 total_steps: int):
        self.optimizer, self.peak_lr = optimizer, peak_lr
        self.multiplier = lr_multiplier(cfg, total_steps)
        self.scales = [group["lr"] / peak_lr for group in optimizer.param_groups]
        self.step_count = 0
        self._apply()

    @property
    def lr(self) -> float:
        """The LR the next optimizer step uses."""
        return self.peak_lr * self.multiplier(self.step_count)

    def _apply(self) -> None:
        for group, scale in zip(self.optimizer.param_groups, self.scales):
            group["lr"] = self.lr * scale

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        self._apply()
