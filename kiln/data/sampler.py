"""Which sample each rank reads next: deterministic from (seed, epoch), sharded, resumable.

The run is a sequence of global slots, `world_size * batch_size` per call. Each slot is given
to a source (mixture weights of the current curriculum stage, interleaved so that every prefix
of a stage is within two samples of the weights), and each source hands out its samples in a
pseudo-random permutation of its epoch, a Feistel cipher keyed by (seed, source, epoch): O(1)
memory whatever the dataset size. Rank r takes slots [r*B, (r+1)*B) of each global batch, so no
two ranks read the same sample and together they cover each epoch exactly. The whole position
is a few integers (`state_dict`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kiln.errors import KilnError


def _key(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    # splitmix64 finaliser: a good 64-bit hash; uint64 arithmetic wraps as intended.
    x = x ^ np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, seed: int, stream: int, epoch: int) -> np.ndarray:
    """A bijection of range(n), applied to `index`: a 4-round Feistel cipher with cycle walking."""
    if n <= 1:
        return np.zeros_like(np.asarray(index, dtype=np.int64))
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [_key(seed, stream, epoch, r) for r in range(4)]

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        return (left << np.uint64(half)) | right

    x = encrypt(np.asarray(index, dtype=np.uint64))
    # The cipher permutes [0, 4**half), at most 4n values: re-encrypt until inside [0, n).
    while (outside := x >= np.uint64(n)).any():
        x[outside] = encrypt(x[outside])
    return x.astype(np.int64)


@dataclass
class Stage:
    until: int
    """The first global slot after this stage."""
    weights: np.ndarray
    """Normalised, one per source."""
    seq_len: int | None = None


class Sampler:
    """Global slots -> (source, sample index) for one rank; the state is a few integers."""

    def __init__(self, sizes: list[int], stages: list[Stage], seed: int, batch_size: int,
                 rank: int = 0, world_size: int = 1, shuffle: list[bool] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.sizes, self.stages, self.seed = sizes, stages, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle = shuffle or [True] * len(sizes)
        self.position = 0
        """Global slots handed out so far, across all ranks."""
        self.consumed = [0] * len(sizes)
        """Samples taken from each source so far, across all ranks and epochs."""
        self.stage_counts = [0] * len(sizes)
        """Samples taken from each source in the current stage (for the interleaving)."""
        self.stage = 0

    def stage_at(self, slot: int) -> int:
        for i, stage in enumerate(self.stages):
            if slot < stage.until:
                return i
        return len(self.stages) - 1

    def next_batch(self) -> tuple[list[tuple[int, int]], Stage]:
        """This rank's batch as (source, sample index) pairs, and the stage it was drawn in."""
        stage_index = self.stage_at(self.position)  # a batch is drawn whole in one stage
        if stage_index != self.stage:
            self.stage, self.stage_counts = stage_index, [0] * len(self.sizes)
        stage = self.stages[stage_index]
        global_batch = self.world_size * self.batch_size
        sources = self._assign(global_batch, stage.weights)
        first = self.rank * self.batch_size
        mine: list[tuple[int, int, int]] = []  # (slot, source, sample)
        for s in range(len(self.sizes)):
            slots = np.flatnonzero(sources == s)
            if not len(slots):
                continue
            # Source s's k-th draw overall is sample permute(k mod size) of epoch k // size.
            draws = self.consumed[s] + np.arange(len(slots))
            self.consumed[s] += len(slots)
            local = slots[(slots >= first) & (slots < first + self.batch_size)]
            if not len(local):
                continue
            picked = draws[np.searchsorted(slots, local)]
            samples = self._lookup(s, picked)
            mine.extend(zip(local.tolist(), [s] * len(local), samples.tolist()))
        self.position += global_batch
        mine.sort()
        return [(s, i) for _, s, i in mine], stage

    def _assign(self, count: int, weights: np.ndarray) -> np.ndarray:
        """Stride scheduling: source s's k-th draw of the stage is due at (k + 1/2) / w_s; the next
        `count` slots go to the earliest due draws (ties: the source listed first), so every
        prefix of a stage is within two samples (Webster apportionment) of each source's share."""
        if len(self.sizes) == 1:
            return np.zeros(count, dtype=np.int64)
        counts = np.asarray(self.stage_counts, dtype=np.int64)
        k = counts[:, None] + 0.5 + np.arange(count)[None, :]
        with np.errstate(divide="ignore"):
            due = k / weights[:, None]  # a weight of 0: never due
        source = np.broadcast_to(np.arange(len(self.sizes))[:, None], due.shape)
        order = np.lexsort((source.ravel(), due.ravel()))[:count]
        out = source.ravel()[order]
        self.stage_counts = (counts + np.bincount(out, minlength=len(self.sizes))).tolist()
        return out

    def _lookup(self, source: int, draws: np.ndarray) -> np.ndarray:
        n = self.sizes[source]
        epochs, within = draws // n, draws % n
        if not self.shuffle[source]:
            return within
        out = np.empty_like(draws)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = permute(within[sel], n, self.seed, source, int(epoch))
        return out

    def state_dict(self) -> dict:
        return {"position": self.position, "consumed": list(self.consumed),
                "stage": self.stage, "stage_counts": list(self.stage_counts),
                "world_size": self.world_size, "batch_size": self.batch_size,
                "sizes": list(self.sizes)}

    def load_state_dict(self, state: dict) -> None:
        # The position and counts are global (every rank holds the same), so another number of
        # data-parallel ranks or another micro-batch size continues at the same sample, as long
        # as the position falls on one of this run's calls (it does at an optimizer step: a
        # step's global batch is a multiple of world size x micro-batch).
        if state["position"] % (self.world_size * self.batch_size):
            raise KilnError(
                f"the data position ({state['position']} samples, saved with world size "
                f"{state['world_size']} and batch size {state['batch_size']}) is not a multiple "
                f"of this run's {self.world_size} x {self.batch_size} samples per call, so it "
                "cannot continue at the exact same sample")
        if list(state["sizes"]) != list(self.sizes):
            raise KilnError(
                f"the data position was saved over sources of {state['sizes']} samples; this "
                f"run's sources have {self.sizes} (were they prepared again, or is data.seq_len "
                "different?), so it cannot continue at the exact same sample")
        self.position, self.stage = state["position"], state["stage"]
        self.consumed, self.stage_counts = list(state["consumed"]), list(state["stage_counts"])
