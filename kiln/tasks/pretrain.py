"""Pretraining (and continued pretraining): next-token prediction on packed token shards."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kiln.config import JobConfig
from kiln.data.batch import Batch
from kiln.data.pipeline import Data, build_data
from kiln.train.loss import aux_loss_sum, chunked_cross_entropy


class Pretrain:
    name = "pretrain"
    sparse_targets = False
    """True where most positions are no target (fine-tuning's prompts): the loss then runs the
    output layer on the target rows only."""

    def build_data(self, cfg: JobConfig, run_dir: Path, dp_rank: int, dp_size: int) -> Data:
        return build_data(cfg, run_dir, dp_rank, dp_size)

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Cross-entropy summed over the batch's targets (the trainer divides by the global
        count); the model returns hidden states and the loss runs the head in chunks. A mixture
        of experts adds its auxiliary losses once per target (see aux_loss_sum)."""
        hidden = model(batch.tokens, **batch.model_inputs(), return_hidden=True)
        loss = chunked_cross_entropy(hidden, model.lm_head, batch.labels, targets_only=self.sparse_targets)
        aux = aux_loss_sum(model, batch.count_targets())
        return loss if aux is None else loss + aux
