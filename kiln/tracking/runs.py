"""`kiln runs DIR`: one line per run directory, from its files alone (no tracker needed)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from kiln.tracking import read_status
from kiln.tracking.jsonl import METRICS_FILE, read_metrics
from kiln.tracking.lineage import chain_names, read_lineage


@dataclass
class RunRow:
    name: str
    status: str
    steps: int | None
    tokens: int | None
    best_eval: float | None
    wall_s: float | None
    parent: str


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _status(run_dir: Path) -> tuple[str, float | None]:
    status = read_status(run_dir)
    if status is not None:
        state = status.get("state", "?")
        if state == "running" and status.get("host") == socket.gethostname() \
                and not _alive(int(status.get("pid", 0))):
            state = "stopped"  # the process is gone without finishing: killed or crashed
        return state, status.get("wall_s")
    # A run from before trackers: finished when its final weights are there.
    metrics = run_dir / METRICS_FILE
    config = run_dir / "config.yaml"
    wall = metrics.stat().st_mtime - config.stat().st_mtime if metrics.is_file() and config.is_file() else None
    return ("finished" if (run_dir / "model.safetensors").is_file() else "unknown"), wall


def _parent(run_dir: Path) -> str:
    lineage = read_lineage(run_dir) or {}
    parent = lineage.get("parent")
    if not parent:
        return "-"
    names = chain_names(parent)
    return f"run {names[0]}" if names else f"{parent.get('kind')} {Path(parent.get('path', '')).name}"


def list_runs(directory: str | Path) -> list[RunRow]:
    """Every run directory (one holding config.yaml or metrics.jsonl) under `directory`."""
    directory = Path(directory)
    candidates = [directory] + sorted(p for p in directory.iterdir() if p.is_dir()) \
        if directory.is_dir() else []
    rows = []
    for run_dir in candidates:
        if not ((run_dir / "config.yaml").is_file() or (run_dir / METRICS_FILE).is_file()):
            continue
        records = read_metrics(run_dir)
        steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
        tokens = [r["tokens"] for r in records if isinstance(r.get("tokens"), int)]
        evals = [r["val_loss"] for r in records if isinstance(r.get("val_loss"), (int, float))]
        status, wall = _status(run_dir)
        rows.append(RunRow(run_dir.name, status, max(steps, default=None),
                           max(tokens, default=None), min(evals, default=None), wall,
                           _parent(run_dir)))
    return rows


def format_runs(rows: list[RunRow]) -> str:
    header = ("name", "status", "steps", "tokens", "best val_loss", "wall time", "parent")
    table = [header] + [(r.name, r.status, _num(r.steps), _num(r.tokens),
                         "-" if r.best_eval is None else f"{r.best_eval:.4f}",
                         _duration(r.wall_s), r.parent) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table)


def _num(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"
