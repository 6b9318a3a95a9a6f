"""Pack token streams into fixed-length sequences and serve shuffled, resumable batches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from kiln.data.tokenizer import EOS


def tokenize_documents(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream of token ids: each document followed by EOS."""
    eos = tokenizer.token_to_id(EOS)
    ids = [np.asarray(e.ids + [eos], dtype=np.int32) for e in tokenizer.encode_batch(texts)]
    return torch.from_numpy(np.concatenate(ids))


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(n, seq_len + 1) blocks: inputs are block[:-1], targets block[1:]; the tail is dropped."""
    n = len(stream) // (seq_len + 1)
    return stream[: n * (seq_len + 1)].view(n, seq_len + 1)


class PackedLoader:
    """Endless batches over packed blocks, reshuffled each epoch from (seed, epoch).

    Its position is a small state dict, so a resumed run sees exactly the batches an
    uninterrupted one would have seen next.
    """

    def __init__(self, blocks: torch.Tensor, batch_size: int, seed: int):
        if len(blocks) < batch_size:
            raise ValueError(f"only {len(blocks)} sequences, fewer than one batch of {batch_size}")
        self.blocks, self.batch_size, self.seed = blocks, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(len(self.blocks), generator=g)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        index = self._order[self.position: self.position + self.batch_size]
        self.position += self.batch_size
        batch = self.blocks[index].long()
        return batch[:, :-1], batch[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()


def fixed_batches(blocks: torch.Tensor, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first n_batches batches of blocks, in order: a validation set that never changes."""
    out = []
    for start in range(0, min(len(blocks), n_batches * batch_size), batch_size):
        batch = blocks[start: start + batch_size].long()
        out.append((batch[:, :-1], batch[:, 1:]))
    return out
