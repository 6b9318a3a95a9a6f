"""TensorBoard event files in the run directory (`tensorboard --logdir <out_dir>` compares runs)."""

from __future__ import annotations

from pathlib import Path


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: Path, resumed_step: int | None):
        self.run_dir, self.last_steps = Path(run_dir), {}
        # purge_step makes TensorBoard's reader drop points at or after it from earlier event
        # files: a resumed run re-runs the steps after its checkpoint, and a fresh run in a
        # reused directory starts over. None (adding eval results) purges nothing.
        self.purge_step = None if resumed_step is None else (resumed_step + 1 if resumed_step else 0)
        self.writer = None

    def _open(self):
        from torch.utils.tensorboard import SummaryWriter

        # The writer's queue is flushed by close(); max_queue small so a crash loses little.
        return SummaryWriter(str(self.run_dir), purge_step=self.purge_step, max_queue=10,
                             flush_secs=5)

    def write(self, items: list[dict]) -> None:
        try:
            if self.writer is None:
                self.writer = self._open()
                self.purge_step = None  # once per session: a reopened writer purges nothing
            for item in items:
                if item["kind"] == "metrics":
                    for key, value in item["metrics"].items():
                        self.writer.add_scalar(key, value, item["step"], walltime=item["time"])
                else:
                    text = "\n".join(f"    {k}: {v}" for k, v in {**item["params"], **item["tags"]}.items())
                    self.writer.add_text("config", text, 0)
            self.writer.flush()
        except Exception:
            self._drop()  # after a failure (disk full), a new event file on the next attempt
            raise

    def _drop(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass

    def close(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
