"""Guards a long run needs on a shared cluster, as parts the trainer calls at step boundaries:

- `StepGuard`: a non-finite loss or gradient norm, or a loss spike (k standard deviations above
  a moving window of recent good steps), skips that optimizer step; N bad steps in a row ask for
  a rollback to the last checkpoint (skipping those batches on the replay); too many bad steps
  stop the run with the steps and data positions named.
- `HangWatchdog`: a thread that dumps every thread's Python stack when a step takes far longer
  than the recent median, and exits the process (for the launcher to restart) after a limit.
- `PreemptionFlag`: SIGTERM/SIGUSR1 handlers that only set a flag; the trainer asks
  `should_stop()` (all ranks agree) at step boundaries, checkpoints and exits with
  EXIT_RESTART.

The values the guards see must be the same on every rank (the loss all-reduced, the gradient
norm is global already), so every rank takes the same decision without more communication.
"""

from __future__ import annotations

import faulthandler
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Callable, Iterator, TextIO

from kiln.config import GuardsConfig
from kiln.errors import KilnError

EXIT_RESTART = 75
"""Exit status for "stopped on purpose, restart me" (EX_TEMPFAIL): after a preemption checkpoint
or a hang. torchrun (--max-restarts), Kubernetes (restartPolicy OnFailure) and kiln's sbatch
script restart on any non-zero status; this one says why."""


class Action(str, Enum):
    APPLY = "apply"
    """A good step: take the optimizer step."""
    SKIP = "skip"
    """A bad step: zero the gradients, do not step (the scheduler and data still advance)."""
    ROLLBACK = "rollback"
    """Too many bad steps in a row: restore the last checkpoint, then replay, skipping the
    batches of the bad steps (`StepGuard.skip_batch`)."""


@dataclass
class BadStep:
    step: int
    reason: str
    loss: float
    grad_norm: float
    position: Any = None
    """Where the batch came from (e.g. the loader's state), to name it in the final error."""


class StepGuard:
    """Decides, per step, from the (all-rank) loss and gradient norm, what the trainer does."""

    def __init__(self, window: int = 100, k: float = 6.0, min_history: int = 20,
                 rollback_after: int | None = 3, max_bad_steps: int = 20):
        """window: recent good losses kept; k: a loss above mean + k * std of them is a spike
        (only once min_history losses are known); rollback_after: bad steps in a row that ask
        for a rollback (None: only skip); max_bad_steps: bad steps in all before the run stops."""
        if window < 2 or min_history < 2 or min_history > window or k <= 0:
            raise ValueError("need window >= min_history >= 2 and k > 0")
        self.k, self.min_history = k, min_history
        self.rollback_after, self.max_bad_steps = rollback_after, max_bad_steps
        self._window: deque[tuple[int, float]] = deque(maxlen=window)
        self.bad_steps: list[BadStep] = []
        self._streak: list[int] = []
        self._skip: set[int] = set()

    @classmethod
    def from_config(cls, cfg: GuardsConfig) -> StepGuard:
        return cls(window=cfg.spike_window, k=cfg.spike_k, min_history=cfg.spike_min_history,
                   rollback_after=cfg.rollback_after, max_bad_steps=cfg.max_bad_steps)

    def spike_threshold(self) -> float | None:
        """The loss above which a step is a spike; None while the window is too short."""
        if len(self._window) < self.min_history:
            return None
        losses = [loss for _, loss in self._window]
        return statistics.fmean(losses) + self.k * statistics.pstdev(losses)

    def check(self, step: int, loss: float, grad_norm: float, position: Any = None) -> Action:
        """Call once per step with the global loss and gradient norm, before optimizer.step()."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            reason = "non-finite " + ("loss" if not math.isfinite(loss) else "gradient norm")
        elif (limit := self.spike_threshold()) is not None and loss > limit:
            reason = f"loss spike ({loss:.4g} > {limit:.4g}, {self.k:g} std above the window)"
        else:
            self._window.append((step, loss))
            self._streak.clear()
            return Action.APPLY
        self.bad_steps.append(BadStep(step, reason, loss, grad_norm, position))
        self._streak.append(step)
        if len(self.bad_steps) > self.max_bad_steps:
            listed = "; ".join(f"step {b.step}: {b.reason}"
                               + (f" (data position {b.position})" if b.position is not None
                                  else "") for b in self.bad_steps[-10:])
            raise KilnError(f"{len(self.bad_steps)} bad steps (more than guard max_bad_steps="
                            f"{self.max_bad_steps}); the run stops. The last ones: {listed}. "
                            f"Check the data at these positions, or lower the learning rate")
        if self.rollback_after and len(self._streak) >= self.rollback_after:
            return Action.ROLLBACK
        return Action.SKIP

    def rolled_back(self, to_step: int) -> set[int]:
        """The trainer restored the checkpoint of to_step: forget the window after it, and
        return the steps whose batches the replay must skip (those of the bad streak)."""
        self._skip.update(self._streak)
        self._streak.clear()
        kept = [(s, loss) for s, loss in self._window if s <= to_step]
        self._window.clear()
        self._window.extend(kept)
        return set(self._skip)

    def skip_batch(self, step: int) -> bool:
        """True for a step whose batch caused a rollback: read it, but do not train on it."""
        return step in self._skip

    def state_dict(self) -> dict:
        """Plain lists and numbers (JSON): what a checkpoint keeps, so a restarted run takes the
        same decisions and keeps counting toward max_bad_steps."""
        return {"window": [[s, loss] for s, loss in self._window],
                "bad_steps": [asdict(b) for b in self.bad_steps], "skip": sorted(self._skip),
                "streak": list(self._streak)}

    def load_state_dict(self, state: dict) -> None:
        self._window.clear()
        self._window.extend((int(s), float(loss)) for s, loss in state["window"])
        self.bad_steps = [BadStep(**b) for b in state["bad_steps"]]
        self._skip = {int(s) for s in state["skip"]}
        self._streak = [int(s) for s in state.get("streak", [])]


def all_ranks_agree(flag: bool, device: Any = "cpu") -> bool:
    """True on every rank if flag is true on any (one small all-reduce; the flag alone without
    a process group). device: where the process group's backend wants tensors (cuda for NCCL)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class PreemptionFlag:
    """Handlers for SIGTERM and SIGUSR1 (Kubernetes eviction, Kueue preemption, Slurm's warning)
    that only set a flag; the trainer checks it at step boundaries. A second signal within
    `repeat_within` seconds of the first is the same notice arriving twice (Slurm signals every
    process of a step and torchrun forwards it again) and is ignored; a later one means "now":
    the signal's default action runs (the process ends; the last committed checkpoint stays)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1),
                 repeat_within: float = 5.0):
        self.signals, self.repeat_within = signals, repeat_within
        self.received: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def from_config(cls, cfg: GuardsConfig) -> PreemptionFlag:
        return cls(tuple(signal.Signals[name] for name in cfg.preemption_signals))

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def signal_name(self) -> str | None:
        return signal.Signals(self.received).name if self.received is not None else None

    def install(self) -> PreemptionFlag:
        """Install the handlers (from the main thread); uninstall() restores the previous ones."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionFlag:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received_at is None:
            self.received, self.received_at = signum, now
            print(f"kiln: {signal.Signals(signum).name} received: saving a checkpoint at the "
                  f"next step boundary, then exiting", file=sys.stderr, flush=True)
        elif now - self.received_at > self.repeat_within:
            print(f"kiln: {signal.Signals(signum).name} received again: exiting now; the last "
                  f"committed checkpoint stays", file=sys.stderr, flush=True)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def set(self, signum: int = signal.SIGTERM) -> None:
        """Raise the flag without a signal (a test hook, or a wall-clock budget)."""
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()

    def should_stop(self, device: Any = "cpu") -> bool:
        """Collective: every rank must call it at the same step; true on all if any got a signal."""
        return all_ranks_agree(self.requested, device)


class HangWatchdog:
    """A daemon thread watching the time since the last `beat()` (one per step). When it passes
    max(factor x the recent median step time, min_seconds), every thread's Python stack goes to
    `out` (faulthandler: works even while the main thread is stuck in C code, e.g. a collective);
    when it passes `exit_after` seconds, the stacks are dumped again and the process exits with
    EXIT_RESTART so the launcher restarts the job (which resumes from its last checkpoint)."""

    def __init__(self, factor: float = 10.0, min_seconds: float = 60.0,
                 exit_after: float | None = 1800.0, first_step_seconds: float = 1800.0,
                 window: int = 50, poll: float = 1.0, out: TextIO | None = None,
                 exit: Callable[[int], None] = os._exit):
        """first_step_seconds: the limit before any step time is known (start-up, compile).
        exit_after: None never exits. exit: how to end the process (os._exit: a stuck main
        thread cannot be interrupted politely)."""
        self.factor, self.min_seconds, self.exit_after = factor, min_seconds, exit_after
        self.first_step_seconds, self.poll = first_step_seconds, poll
        self.out = out or sys.stderr
        self._exit = exit
        self._times: deque[float] = deque(maxlen=window)
        self._last = time.monotonic()
        self._dumped = False
        self._paused = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dumps = 0

    @classmethod
    def from_config(cls, cfg: GuardsConfig, **kw) -> HangWatchdog:
        return cls(factor=cfg.hang_factor, min_seconds=cfg.hang_min_seconds,
                   exit_after=cfg.hang_exit_after, **kw)

    def start(self) -> HangWatchdog:
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kiln-hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def beat(self) -> None:
        """A step finished: record its duration and restart the clock."""
        now = time.monotonic()
        with self._lock:
            self._times.append(now - self._last)
            self._last, self._dumped = now, False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not watched: a known long operation (evaluation, a checkpoint save); the clock
        restarts after it, and its time is not a step time."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._last, self._dumped = time.monotonic(), False

    def limit(self) -> float:
        """Seconds without a beat that count as a hang now."""
        with self._lock:
            if not self._times:
                return self.first_step_seconds
            return max(self.factor * statistics.median(self._times), self.min_seconds)

    def _dump(self, why: str) -> None:
        self.out.write(f"kiln: hang watchdog (pid {os.getpid()}, rank "
                       f"{os.environ.get('RANK', '0')}): {why}; Python stacks of every thread:\n")
        self.out.flush()
        faulthandler.dump_traceback(file=self.out, all_threads=True)
        self.out.flush()
        self.dumps += 1

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            limit = self.limit()
            with self._lock:
                if self._paused:
                    continue
                waited, dumped = time.monotonic() - self._last, self._dumped
            if waited > limit and not dumped:
                self._dump(f"no step finished for {waited:.0f} s (limit {limit:.0f} s)")
                with self._lock:
                    self._dumped = True
            if self.exit_after is not None and waited > self.exit_after:
                self._dump(f"still no step after {waited:.0f} s: exiting with status "
                           f"{EXIT_RESTART} for the launcher to restart the job")
                self._exit(EXIT_RESTART)
                return
