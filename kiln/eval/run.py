"""`kiln eval`: score a run, a checkpoint or a Hugging Face directory on task files; a run's
results are appended to its metrics.jsonl and sent to its trackers at the evaluated step."""

from __future__ import annotations

from pathlib import Path

from kiln.eval.load import Loaded, load_for_eval
from kiln.eval.tasks import run_tasks


def evaluate(target: str, tasks: list[str], device: str = "cpu",
             max_new_tokens: int = 32) -> tuple[dict[str, float], Loaded]:
    loaded = load_for_eval(target, device)
    results = run_tasks(loaded.model, loaded.tokenizer, tasks, max_new_tokens)
    if loaded.run_dir is not None and results:
        report_to_run(loaded.run_dir, {"step": loaded.step or 0, **results})
    return results, loaded


def report_to_run(run_dir: Path, record: dict) -> None:
    from kiln.checkpoint.hf_export import read_job
    from kiln.tracking import Trackers
    from kiln.tracking.jsonl import METRICS_FILE, MetricsLog

    MetricsLog(run_dir / METRICS_FILE, None, "off").log(record)
    config = run_dir / "config.yaml"
    if config.is_file():
        # Where the run is now, whatever directory it was trained from (the default MLflow
        # store sits next to it).
        cfg = read_job(config.read_text(), str(config)).model_copy(
            update={"out_dir": str(run_dir.parent), "name": run_dir.name})
        trackers = Trackers.open(cfg, run_dir, rank=0, resumed_step=None)
        trackers.log(record)
        trackers.close()
