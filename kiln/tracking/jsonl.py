"""metrics.jsonl and the console: one JSON line per logging interval, shown as a line or a bar.

Always on, whatever else is configured: it is the record every other tracker can be rebuilt
from, and what `kiln runs` and `kiln plot` read.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def round_record(record: dict) -> dict:
    """Floats to 6 decimals: what metrics.jsonl holds, and so what every tracker is given."""
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()}


class MetricsLog:
    """Appends one JSON object per logging interval to metrics.jsonl and shows it."""

    def __init__(self, path: Path, total_steps: int | None, progress_bar: str, start_step: int = 0):
        self.path = path
        show_bar = progress_bar == "on" or (progress_bar == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True) if show_bar else None

    def log(self, record: dict) -> None:
        record = round_record(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order; a torn last line (a crash) is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one numeric metric; a step logged twice (a resumed run re-running
    steps after its checkpoint) keeps its last value."""
    by_step: dict[int, float] = {}
    for r in records:
        v = r.get(key)
        if isinstance(r.get("step"), int) and isinstance(v, (int, float)) and not isinstance(v, bool) \
                and math.isfinite(v):
            by_step[r["step"]] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]
