"""The best checkpoint by a chosen eval metric (tracking.best_metric), kept by retention.

The trainer shows every eval record to `observe`; when a checkpoint is committed, `select`
picks, among the committed steps that have an eval value, the best, records it in best.json
and returns it for `Storage.apply_retention(..., keep={best})`.
"""

from __future__ import annotations

import json
from pathlib import Path

BEST_FILE = "best.json"


class BestCheckpoint:
    def __init__(self, run_dir: str | Path, metric: str = "val_loss", mode: str = "min"):
        self.path = Path(run_dir) / BEST_FILE
        self.metric, self.mode = metric, mode
        saved = self._read()
        # Values by step survive a resume, so a checkpoint from before it can stay the best.
        self.values: dict[int, float] = {int(k): v for k, v in saved.get("values", {}).items()} \
            if saved.get("metric") == metric else {}

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def observe(self, record: dict) -> None:
        """An eval record ({"step": ..., metric: value, ...}); others are ignored."""
        value = record.get(self.metric)
        if isinstance(record.get("step"), int) and isinstance(value, (int, float)):
            self.values[record["step"]] = float(value)

    def select(self, committed_steps: list[int]) -> int | None:
        """The best committed step with an eval value (None if none has one); writes best.json."""
        scored = [s for s in committed_steps if s in self.values]
        if not scored:
            return None
        sign = 1 if self.mode == "min" else -1
        best = min(scored, key=lambda s: (sign * self.values[s], -s))  # ties: the later step
        record = {"metric": self.metric, "mode": self.mode, "step": best,
                  "value": self.values[best], "values": self.values}
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(self.path)
        return best
