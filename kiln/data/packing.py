"""Supervised fine-tuning examples as training rows: fitted to seq_len, packed or padded.

An example of n tokens gives n - 1 (input, target) positions; a target is kept where the
job's `sft.loss_on` selects it, else it is the ignore index. With packing, examples are laid
end to end in rows of exactly seq_len positions, each with positions restarting at 0 and its
own document id, so attention never crosses examples (the model's block-causal mask) and a
packed row gives the same loss as its examples one per row. The packing is best-fit
decreasing (longest first, each into the row it fills most tightly; equal lengths in the order
of a seeded shuffle), done once, which leaves far less padding than filling rows in order: each
row is one sample of the sampler, which permutes the rows anew every epoch and keeps the
position resumable. Without packing, a
sample is one example and a micro-batch is padded to its longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.data.batch import IGNORE_INDEX, Batch
from kiln.data.chat import LAST_TURN
from kiln.data.shards import ShardSet
from kiln.errors import KilnError


@dataclass
class ExampleCounts:
    examples: int = 0
    """Examples in the prepared set."""
    kept: int = 0
    truncated: int = 0
    """Longer than seq_len + 1 tokens and cut to it (sft.overlong: truncate)."""
    dropped_overlong: int = 0
    """Longer than seq_len + 1 tokens and left out (sft.overlong: drop)."""
    dropped_no_targets: int = 0
    """Left out because no token of theirs is trained on (after any truncation)."""
    targets: int = 0
    """Tokens trained on per epoch."""

    def describe(self) -> str:
        return (f"{self.kept:,} of {self.examples:,} examples ({self.truncated:,} truncated, "
                f"{self.dropped_overlong:,} dropped as too long, {self.dropped_no_targets:,} "
                f"without a trained-on token), {self.targets:,} target tokens")


class SFTExamples:
    """The examples of one split prepared by `kiln prepare --sft`: `len()` rows, `sample(i)`
    (the row's examples as (ids, trained-on flags)), `collate(rows)` -> Batch."""

    order = "shuffle"
    """How the sampler reads the rows (as PackedSamples.order): a new permutation each epoch."""

    def __init__(self, shards: ShardSet, seq_len: int, loss_on: str = "assistant",
                 overlong: str = "truncate", packing: bool = True, seed: int | None = None):
        if not shards.has_mask:
            raise KilnError(f"{shards.directory} was prepared without --sft: it has no loss mask "
                            "to tell prompts from responses; prepare it with kiln prepare --sft")
        self.shards, self.seq_len, self.loss_on, self.packing = shards, seq_len, loss_on, packing
        self.pad_id = int(shards.manifest["tokenizer"]["eos_id"])
        starts, lengths = shards.documents()
        over = lengths > seq_len + 1
        self.starts, self.lengths = starts, np.minimum(lengths, seq_len + 1)  # tokens kept
        targets = self._count_targets(lengths)
        dropped = over if overlong == "drop" else np.zeros_like(over)
        keep = (targets > 0) & ~dropped
        self.counts = ExampleCounts(
            examples=len(lengths), kept=int(keep.sum()), truncated=int((over & keep).sum()),
            dropped_overlong=int(dropped.sum()),
            dropped_no_targets=int(((targets == 0) & ~dropped).sum()),
            targets=int(targets[keep].sum()))
        picked = np.flatnonzero(keep)
        if seed is not None:
            picked = picked[np.random.default_rng(seed).permutation(len(picked))]
        if packing:
            order, self.row_starts = _best_fit_decreasing(self.lengths[picked] - 1, seq_len)
            picked = picked[order]
        else:
            self.row_starts = np.arange(len(picked) + 1)
        self.row_starts: np.ndarray
        """Row r holds examples picked[row_starts[r]:row_starts[r + 1]]."""
        self.picked = picked
        """The kept examples, row by row."""

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def _select(self, mask: np.ndarray) -> np.ndarray:
        if self.loss_on == "all":
            return np.ones(len(mask), dtype=bool)
        return mask == LAST_TURN if self.loss_on == "last" else mask > 0

    def _count_targets(self, full_lengths: np.ndarray) -> np.ndarray:
        """Trained-on tokens of each example after fitting to seq_len (its first token is
        never a target: nothing comes before it)."""
        out = np.empty(len(self.starts), dtype=np.int64)
        for k in range(len(self.shards.shards)):
            lo, hi = np.searchsorted(self.starts, self.shards.starts[k:k + 2])
            if lo == hi:
                continue
            begin = self.starts[lo:hi] - self.shards.starts[k]
            selected = self._select(np.asarray(self.shards.mask_shard(k)))
            counts = np.add.reduceat(selected, begin, dtype=np.int64) - selected[begin]
            # Examples cut to seq_len + 1 tokens: count only what is left of them.
            for j in np.flatnonzero(self.lengths[lo:hi] < full_lengths[lo:hi]):
                counts[j] = selected[begin[j] + 1: begin[j] + self.lengths[lo + j]].sum()
            out[lo:hi] = counts
        return out

    def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Example e's kept tokens and the raw mask values (0 prompt, 1 turn, 2 last turn)."""
        start, n = int(self.starts[e]), int(self.lengths[e])
        return self.shards.read(start, n), self.shards.read(start, n, mask=True)

    def sample(self, i: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Row i: its examples, each as (token ids, whether each token is a target)."""
        out = []
        for e in self.picked[self.row_starts[i]:self.row_starts[i + 1]]:
            ids, mask = self.example(int(e))
            out.append((ids, self._select(mask)))
        return out

    def collate(self, rows: list[list[tuple[np.ndarray, np.ndarray]]],
                stage=None) -> tuple[Batch, int]:
        """Rows -> Batch and its count of padding positions. Packed: (B, seq_len) with positions
        and document ids (padding is document -1); unpacked: (B, longest) of plain causal rows."""
        if stage is not None and stage.seq_len is not None and stage.seq_len != self.seq_len:
            raise KilnError("data.curriculum seq_len stages are for pretraining, not task sft")
        used = [sum(len(ids) - 1 for ids, _ in row) for row in rows]
        width = self.seq_len if self.packing else max(used)
        tokens = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros((len(rows), width), dtype=np.int64)
        documents = np.full((len(rows), width), -1, dtype=np.int64)
        for r, row in enumerate(rows):
            at = 0
            for k, (ids, trained) in enumerate(row):
                n = len(ids) - 1
                tokens[r, at:at + n] = ids[:-1]
                labels[r, at:at + n] = np.where(trained[1:], ids[1:], IGNORE_INDEX)
                positions[r, at:at + n] = np.arange(n)
                documents[r, at:at + n] = k
                at += n
        t = torch.from_numpy
        batch = (Batch(t(tokens), t(labels), t(positions), t(documents)) if self.packing
                 else Batch(t(tokens), t(labels)))  # right padding: causal rows never see it
        return batch, len(rows) * width - sum(used)

    def prompt_and_reply(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k-th kept example cut before its last assistant turn: (prompt ids, reply ids)."""
        ids, mask = self.example(int(self.picked[k]))
        last = np.flatnonzero(mask == LAST_TURN)
        if not len(last):  # truncated before its reply
            return ids, ids[:0]
        return ids[:last[0]], ids[last[0]:last[-1] + 1]


def _best_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Bin packing of items of `sizes` into rows of `capacity`: items longest first (equal sizes
    in their given order), each into the open row with the least room that still fits it, a new
    row when none does. (item order, row starts): row r holds order[starts[r]:starts[r + 1]]."""
    rows: list[list[int]] = []
    with_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # rows by their room left
    any_with_room = np.zeros(capacity + 1, dtype=bool)
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        room = size + int(any_with_room[size:].argmax())
        if any_with_room[room]:
            r = with_room[room].pop()
            any_with_room[room] = bool(with_room[room])
        else:
            r, room = len(rows), capacity
            rows.append([])
        rows[r].append(i)
        with_room[room - size].append(r)
        any_with_room[room - size] = True
    order = np.asarray([i for row in rows for i in row], dtype=np.int64)
    starts = np.cumsum([0] + [len(row) for row in rows], dtype=np.int64)
    return order, starts
