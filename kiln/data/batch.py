"""What one micro-batch holds, from the loader through the pipeline to the loss."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

IGNORE_INDEX = -100


@dataclass
class Batch:
    tokens: torch.Tensor
    """(batch, seq) int64 inputs."""
    labels: torch.Tensor
    """(batch, seq) int64 next-token targets; IGNORE_INDEX (-100) where no loss is taken
    (prompt tokens of supervised fine-tuning, padding)."""
    positions: torch.Tensor | None = None
    """(batch, seq) position of each token within its own example (RoPE); None: 0..seq-1."""
    document_ids: torch.Tensor | None = None
    """(batch, seq) which packed example each token belongs to; tokens attend only within
    their own. None: plain causal attention over the whole sequence."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return replace(self, **{f.name: t.to(device, non_blocking=non_blocking)
                                for f in fields(self) if (t := getattr(self, f.name)) is not None})

    def pin_memory(self) -> Batch:
        return replace(self, **{f.name: t.pin_memory()
                                for f in fields(self) if (t := getattr(self, f.name)) is not None})

    def model_inputs(self) -> dict:
        """Keyword arguments of the model's forward besides the tokens."""
        return {"positions": self.positions, "document_ids": self.document_ids}

    def count_targets(self) -> torch.Tensor:
        """Targets that count toward the loss, as a tensor on the batch's device (no sync)."""
        return (self.labels != IGNORE_INDEX).sum()
