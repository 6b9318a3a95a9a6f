"""Packed samples -> Batch(tokens, labels), read ahead in a background thread, resumable."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np

from kiln.data.batch import IGNORE_INDEX, Batch
from kiln.data.sampler import Sampler, Stage
from kiln.errors import KilnError


class ShardLoader:
    """Endless training batches of shape (micro_batch, seq_len) from one or more sources.

    The sources (PackedSamples for pretraining, SFTExamples for fine-tuning) say how their
    samples become a Batch (`collate`). `state_dict()` is the position after the last batch
    handed out (not the last one read ahead), so a run resumed from it sees exactly the batches
    an uninterrupted run would have.
    """

    def __init__(self, sources: list, names: list[str], sampler: Sampler,
                 prefetch: int = 2, pin_memory: bool = False):
        self.sources, self.names, self.sampler = sources, names, sampler
        self.prefetch, self.pin_memory = prefetch, pin_memory
        self._state = sampler.state_dict()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._counts = np.zeros(3, dtype=np.int64)  # positions, padding, targets handed out

    def __iter__(self) -> Iterator[Batch]:
        return self

    def _produce(self) -> tuple[Batch, dict, np.ndarray]:
        picks, stage = self.sampler.next_batch()
        batch, padding = self.sources[0].collate([self.sources[s].sample(i) for s, i in picks],
                                                 stage)
        # Counted in numpy: the batch is still on the CPU here, and no device is waited for.
        labels = batch.labels.numpy()
        counts = np.array([labels.size, padding, np.count_nonzero(labels != IGNORE_INDEX)])
        if self.pin_memory:  # lets the copy to the GPU overlap with compute
            batch = batch.pin_memory()
        return batch, self.sampler.state_dict(), counts

    def _run(self) -> None:
        # Read ahead while the trainer computes; numpy and memmap reads release the GIL.
        while not self._stop.is_set():
            try:
                item = self._produce()
            except BaseException as e:  # hand the error to the consumer instead of dying silently
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    pass
            if isinstance(item, BaseException):
                return

    def __next__(self) -> Batch:
        if self.prefetch == 0:
            batch, self._state, counts = self._produce()
            self._counts += counts
            return batch
        if self._thread is None:
            self._queue, self._stop = queue.Queue(self.prefetch), threading.Event()
            self._thread = threading.Thread(target=self._run, name="kiln-data", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        batch, self._state, counts = item
        self._counts += counts
        return batch

    def window_stats(self, steps: int) -> dict[str, float]:
        """Since the last call, on this data-parallel rank: the share of positions that are
        padding, and the tokens trained on (targets) per optimizer step; then start again."""
        positions, padding, targets = self._counts.tolist()
        self._counts[:] = 0
        return {"padding_fraction": padding / max(positions, 1),
                "trained_tokens_per_step": targets / max(steps, 1)}

    def close(self) -> None:
        """Stop reading ahead; the sampler is left past what was read ahead, so reset it."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sampler.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return {"sampler": dict(self._state), "sources": list(self.names)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["sources"]) != self.names:
            raise KilnError(f"the data position was saved for sources {list(state['sources'])}; "
                            f"this run reads {self.names}: it cannot continue at the same sample")
        self.close()
        self.sampler.load_state_dict(state["sampler"])
        self._state = self.sampler.state_dict()

    def tokens_by_source(self) -> dict[str, int]:
        """Target tokens consumed from each source so far, summed over all ranks."""
        seq_len = self.sources[0].seq_len
        return {name: n * seq_len for name, n in zip(self.names, self._state["consumed"])}


def fixed_batches(samples, batch_size: int, n_batches: int) -> list[Batch]:
    """The first n_batches batches of a set (PackedSamples or SFTExamples), in order: a
    validation set that never changes."""
    n = min(len(samples), n_batches * batch_size)
    return [samples.collate([samples.sample(i) for i in range(start, min(start + batch_size, n))])[0]
            for start in range(0, n, batch_size)]


__all__ = ["ShardLoader", "Stage", "fixed_batches"]
