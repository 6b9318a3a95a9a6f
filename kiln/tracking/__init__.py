"""Experiment trackers, several at once behind one interface: metrics.jsonl and the console
(always, kiln/tracking/jsonl.py), TensorBoard and MLflow (as cfg.tracking says).

Every tracker gets the same records, as metrics.jsonl holds them. Each runs in a background thread of its own, so a slow or
dead server never holds up a training step. A tracker that fails warns once and keeps the
records it could not deliver; it tries again every `retry_s` seconds and, once it gets
through, back-fills the gap in order before going on (the records are also in metrics.jsonl).

    trackers = Trackers.open(cfg, run_dir, rank, resumed_step, metrics_log=MetricsLog(...))
    trackers.log_params(...)   # config and system facts: open() does this
    trackers.log(record)       # at every log interval: to metrics.jsonl, the console and the rest
    trackers.advance(1, loss)  # the progress bar
    trackers.close()           # waits for delivery, records checkpoints in lineage.json
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from kiln.config import JobConfig
from kiln.tracking.jsonl import round_record

STATUS_FILE = "status.json"
_STOP = object()


class Tracker(Protocol):
    """One destination. `write` delivers all of `items` or raises."""

    name: str
    last_steps: dict[str, int]
    """The newest step delivered per metric key; points at or before it are not sent again."""

    def write(self, items: list[dict]) -> None: ...

    def close(self, status: str) -> None: ...


def numeric_metrics(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers as flat metric names ({"tokens_by_source": {"web": 3}} ->
    "tokens_by_source/web"); strings, booleans and `step` are not metrics."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key == "step":
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(numeric_metrics(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def flatten_config(tree, prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 0.001}} -> {"optim.lr": "0.001"}: the config as flat parameters."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(flatten_config(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: json.dumps(tree) if isinstance(tree, (list, tuple)) else str(tree)}


class _Channel:
    """A tracker behind a queue and a thread: delivery, warn-once, retry and back-fill."""

    def __init__(self, tracker: Tracker, retry_s: float):
        self.tracker, self.retry_s = tracker, retry_s
        self.queue: queue.Queue = queue.Queue()
        self.pending: list[dict] = []
        self.failed_at: float | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"kiln-{tracker.name}", daemon=True)
        self.thread.start()

    def put(self, item: dict) -> None:
        self.queue.put(item)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            try:
                item = self.queue.get(timeout=self.retry_s if self.pending else None)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    stopping = True
                else:
                    self.pending.append(item)
                try:
                    item = self.queue.get_nowait()
                except queue.Empty:
                    item = None
            due = self.failed_at is None or time.monotonic() - self.failed_at >= self.retry_s
            if self.pending and (due or stopping):
                self._deliver()

    def _deliver(self) -> None:
        sent = 0
        try:
            while self.pending:
                chunk = [self._unsent(i) for i in self.pending[:50]]
                self.tracker.write([i for i in chunk if i is not None])
                last = self.tracker.last_steps
                for item in chunk:
                    if item is not None and item["kind"] == "metrics":
                        for key in item["metrics"]:
                            last[key] = max(last.get(key, -1), item["step"])
                del self.pending[:50]
                sent += len(chunk)
        except Exception as e:  # any failure of a tracker must not stop training
            if self.failed_at is None:
                self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                _warn(f"{self.tracker.name} failed ({self.error}); training goes on, the metrics "
                      f"are in metrics.jsonl, and it is retried every {self.retry_s:g} s")
            self.failed_at = time.monotonic()
            return
        if self.failed_at is not None:
            _warn(f"{self.tracker.name} is back; back-filled {sent} records", note=True)
            self.failed_at = self.error = None

    def _unsent(self, item: dict) -> dict | None:
        if item["kind"] != "metrics":
            return item
        last = self.tracker.last_steps
        metrics = {k: v for k, v in item["metrics"].items() if item["step"] > last.get(k, -1)}
        return {**item, "metrics": metrics} if metrics else None

    def close(self, timeout: float) -> None:
        self.queue.put(_STOP)
        self.thread.join(timeout)
        if self.thread.is_alive() or self.pending:
            waiting = len(self.pending) + self.queue.qsize()
            _warn(f"{self.tracker.name}: {waiting or 'some'} records were not delivered "
                  f"({self.error or 'still sending'}); they are in metrics.jsonl")
            return
        try:
            self.tracker.close("FINISHED")
        except Exception as e:
            _warn(f"{self.tracker.name}: closing failed ({type(e).__name__}: {e})")


def _safely(what: str, fn, *args):
    """Bookkeeping that must not stop training (a full disk, an unreachable object store):
    fn(*args), or None after a warning."""
    try:
        return fn(*args)
    except Exception as e:
        _warn(f"{what} failed ({type(e).__name__}: {e}); training goes on")
        return None


def _warn(message: str, note: bool = False) -> None:
    print(f"kiln: {'note' if note else 'warning'}: {message}", file=sys.stderr, flush=True)


class Trackers:
    """The run's trackers behind one interface; on ranks other than 0, every call does nothing."""

    retry_s = 10.0
    """Seconds between attempts to reach a failed tracker."""
    close_timeout_s = 60.0
    """How long close() waits for the trackers to deliver what they still hold."""

    def __init__(self, run_dir: Path, channels: list[_Channel], cfg: JobConfig | None = None,
                 metrics_log=None):
        self.run_dir, self.channels = Path(run_dir), channels
        self.cfg = cfg
        """Set for a training session: close() then records its outputs and final status."""
        self.metrics_log = metrics_log

    @classmethod
    def open(cls, cfg: JobConfig, run_dir: str | Path, rank: int = 0,
             resumed_step: int | None = 0, resumed_from: str | None = None,
             world_size: int = 1, metrics_log=None) -> Trackers:
        """The trackers cfg.tracking asks for.

        resumed_step: 0 for a fresh training run (a new MLflow run; TensorBoard ignores
        earlier event files in the directory), N for one resumed at step N (the same MLflow
        run and TensorBoard steps, points after N replaced), None to add to a finished run
        (`kiln eval`). resumed_from: the checkpoint resumed. metrics_log: the MetricsLog
        (metrics.jsonl and console) that log() writes first. Lineage and status are written
        here too; only rank 0 writes anything.
        """
        run_dir = Path(run_dir)
        if rank != 0:
            return cls(run_dir, [])
        from kiln.tracking import lineage as lin

        training = resumed_step is not None
        if training:
            record = _safely("collecting the lineage", lin.run_lineage, cfg, run_dir,
                             resumed_from if resumed_step else None) or {}
            if record:
                _safely("writing lineage.json", lin.write_lineage, run_dir, record)
            _safely("writing status.json", _write_status, run_dir, "running", resumed_step == 0)
        else:
            record = lin.read_lineage(run_dir) or {}
        trackers: list[Tracker] = []
        if cfg.tracking.tensorboard:
            from kiln.tracking.tensorboard import TensorBoardTracker

            trackers.append(TensorBoardTracker(run_dir, resumed_step))
        if cfg.tracking.mlflow is not None:
            from kiln.tracking.mlflow import MlflowTracker

            trackers.append(MlflowTracker(cfg, run_dir, resumed_step, lin.lineage_tags(record)))
        self = cls(run_dir, [_Channel(t, cls.retry_s) for t in trackers],
                   cfg if training else None, metrics_log)
        if training:
            facts = {f"system.{k}": str(v) for k, v in lin.system_facts(world_size).items()}
            self.log_params(flatten_config(cfg.model_dump(mode="json", by_alias=True)), facts)
        return self

    def log(self, record: dict) -> None:
        """One record to metrics.jsonl and the console, then to every tracker; returns at once."""
        if self.metrics_log is not None:
            self.metrics_log.log(record)
        if not self.channels or not isinstance(record.get("step"), int):
            return
        metrics = numeric_metrics(round_record(record))
        if metrics:
            for channel in self.channels:
                channel.put({"kind": "metrics", "step": record["step"], "metrics": metrics,
                             "time": time.time()})
        _safely("updating status.json", _touch_status, self.run_dir, record)

    def log_params(self, params: dict[str, str], tags: dict[str, str] | None = None) -> None:
        """Parameters (the resolved config) and tags (system facts) of the run."""
        for channel in self.channels:
            channel.put({"kind": "params", "params": dict(params), "tags": dict(tags or {})})

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        if self.metrics_log is not None:
            self.metrics_log.advance(steps, loss)

    def close(self) -> None:
        """Wait (at most close_timeout_s) for delivery, end the runs; after training, record
        the checkpoints in lineage.json and the run as finished."""
        if self.metrics_log is not None:
            self.metrics_log.close()
        for channel in self.channels:
            channel.close(self.close_timeout_s)
        if self.cfg is not None:
            from kiln.tracking import lineage as lin

            _safely("recording checkpoints in lineage.json", lin.record_checkpoints, self.cfg,
                    self.run_dir)
            _safely("writing status.json", _write_status, self.run_dir, "finished")


# -- status.json: what `kiln runs` shows as status and wall time -----------------------------

def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_status(run_dir: Path, state: str, fresh: bool = False) -> None:
    now = time.time()
    old = {} if fresh else (read_status(run_dir) or {})
    if state == "running":
        # Wall time adds up over the sessions of a resumed run.
        before = old.get("wall_s", 0.0)
        status = {"state": "running", "pid": os.getpid(), "host": socket.gethostname(),
                  "session_start": now, "wall_before_s": before, "wall_s": before, "updated": now}
    else:
        status = {**old, "state": state, "updated": now,
                  "wall_s": old.get("wall_before_s", 0.0) + now - old.get("session_start", now)}
    _save_status(run_dir, status)


def _touch_status(run_dir: Path, record: dict) -> None:
    status = read_status(run_dir)
    if status is None or status.get("state") != "running":
        return
    now = time.time()
    status.update(updated=now, wall_s=status.get("wall_before_s", 0.0) + now - status["session_start"])
    _save_status(run_dir, status)


def _save_status(run_dir: Path, status: dict) -> None:
    tmp = Path(run_dir) / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps(status) + "\n")
    tmp.replace(Path(run_dir) / STATUS_FILE)
