"""Prepared shards, memory-mapped (never loaded whole), seen as fixed-length packed samples.

A split's shards form one token stream: documents joined by EOS, in prepared order. Sample i
is the window stream[i * seq_len : i * seq_len + seq_len + 1] (inputs are its first seq_len
tokens, targets its last seq_len), so every token is a target exactly once per epoch and a
sample may run across documents and shards. With `order="difficulty"` the stream is the
documents sorted by their prepared score, easiest first.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from kiln.data.batch import Batch
from kiln.data.prepare import read_manifest
from kiln.data.sampler import Stage
from kiln.errors import KilnError


class ShardSet:
    """One split ("train", "val") of a directory written by `kiln prepare`."""

    def __init__(self, directory: str | Path, split: str = "train"):
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        if split not in self.manifest["splits"]:
            raise KilnError(f"{self.directory} has no split {split!r} "
                            f"(it has: {', '.join(self.manifest['splits'])})")
        self.split = split
        self.dtype = np.dtype(self.manifest["dtype"])
        self.shards = self.manifest["splits"][split]["shards"]
        counts = [s["tokens"] for s in self.shards]
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.total_tokens = int(self.starts[-1])
        self._maps: dict[int, np.ndarray] = {}
        self._masks: dict[int, np.ndarray] = {}
        self.has_mask = all("mask" in s for s in self.shards)
        """Prepared for supervised fine-tuning: a loss-mask byte per token."""
        for s in self.shards:
            for file, itemsize in ((s["file"], self.dtype.itemsize), (s.get("mask"), 1)):
                if file is None:
                    continue
                path = self.directory / file
                expected = s["tokens"] * itemsize
                size = path.stat().st_size if path.is_file() else None
                if size != expected:
                    found = "is missing" if size is None else f"has {size} bytes"
                    raise KilnError(f"shard {path} {found}, but {self.directory / 'manifest.json'} "
                                    f"says {expected}: rerun kiln prepare")

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.manifest["tokenizer"]["fingerprint"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    def shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            path = self.directory / self.shards[i]["file"]
            data = np.memmap(path, dtype=self.dtype, mode="r", shape=(self.shards[i]["tokens"],))
            # One pass over the shard on first use: a file damaged in place (same size) would
            # otherwise reach the model as ids outside the embedding.
            top = int(data.max()) if len(data) else 0
            if top >= self.vocab_size:
                raise KilnError(f"shard {path} holds token id {top}, outside the "
                                f"{self.vocab_size}-token vocabulary its manifest names: the "
                                "file was changed or damaged; rerun kiln prepare")
            self._maps[i] = data
        return self._maps[i]

    def mask_shard(self, i: int) -> np.ndarray:
        if i not in self._masks:
            self._masks[i] = np.memmap(self.directory / self.shards[i]["mask"], dtype=np.uint8,
                                       mode="r", shape=(self.shards[i]["tokens"],))
        return self._masks[i]

    def read(self, start: int, length: int, mask: bool = False) -> np.ndarray:
        """stream[start : start + length] (or its loss mask), gathered across shard boundaries."""
        out = np.empty(length, dtype=np.uint8 if mask else np.int64)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < length:
            offset = start + done - int(self.starts[i])
            piece = (self.mask_shard(i) if mask else self.shard(i))[offset: offset + length - done]
            out[done: done + len(piece)] = piece
            done += len(piece)
            i += 1
        return out

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) in the stream of every document, in prepared order."""
        starts, lengths = [], []
        for i, s in enumerate(self.shards):
            ends = self._array(s["docs"]).astype(np.int64)
            begin = np.concatenate([[0], ends[:-1]])
            starts.append(begin + self.starts[i])
            lengths.append(ends - begin)
        return np.concatenate(starts), np.concatenate(lengths)

    def scores(self) -> np.ndarray:
        if any("scores" not in s for s in self.shards):
            raise KilnError(f"{self.directory} was prepared without difficulty scores: rerun "
                            "kiln prepare with --score-field to order documents by difficulty")
        return np.concatenate([self._array(s["scores"]) for s in self.shards])

    def _array(self, name: str) -> np.ndarray:
        path = self.directory / name
        try:
            return np.load(path)
        except (OSError, ValueError, EOFError) as e:
            raise KilnError(f"{path} cannot be read ({e}): it is missing or damaged; rerun "
                            "kiln prepare") from None

    def verify(self) -> None:
        """Recompute each shard's sha256 against the manifest (reads everything: slow, thorough)."""
        for s in self.shards:
            for file, expected in ((s["file"], s["sha256"]), (s.get("mask"), s.get("mask_sha256"))):
                if file is None:
                    continue
                digest = hashlib.sha256()
                with open(self.directory / file, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                if digest.hexdigest() != expected:
                    raise KilnError(f"shard {self.directory / file} does not match the sha256 in "
                                    "its manifest: it was changed or damaged; rerun kiln prepare")


class PackedSamples:
    """Random access to the packed samples of a ShardSet: `len()` and `sample(i)`."""

    def __init__(self, shards: ShardSet, seq_len: int, order: str = "shuffle"):
        self.shards, self.seq_len, self.order = shards, seq_len, order
        self._doc_start = self._doc_cum = None
        if order == "difficulty":
            starts, lengths = shards.documents()
            ranked = np.argsort(shards.scores(), kind="stable")
            self._doc_start = starts[ranked]
            self._doc_cum = np.concatenate([[0], np.cumsum(lengths[ranked])])
        self.n = max(0, (shards.total_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def collate(self, rows: list[np.ndarray], stage: Stage | None = None) -> tuple[Batch, int]:
        """Windows -> Batch(inputs, next-token targets) and its count of padding positions (none).
        In a curriculum stage with a shorter seq_len, each (B, L) batch is cut into
        (B * L / seq_len, seq_len): the same tokens per step, shorter sequences."""
        batch = torch.from_numpy(np.stack(rows))
        x, y = batch[:, :-1], batch[:, 1:]
        if stage is not None and stage.seq_len is not None and stage.seq_len != x.shape[1]:
            x, y = x.reshape(-1, stage.seq_len), y.reshape(-1, stage.seq_len)
        return Batch(x.contiguous(), y.contiguous()), 0

    def sample(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        if self._doc_cum is None:
            return self.shards.read(start, self.seq_len + 1)
        # Difficulty order: gather the window from the documents in ranked order.
        out, done = [], 0
        d = int(np.searchsorted(self._doc_cum, start, side="right")) - 1
        while done < self.seq_len + 1:
            offset = start + done - int(self._doc_cum[d])
            take = min(int(self._doc_cum[d + 1] - self._doc_cum[d]) - offset,
                       self.seq_len + 1 - done)
            out.append(self.shards.read(int(self._doc_start[d]) + offset, take))
            done += take
            d += 1
        return np.concatenate(out)
