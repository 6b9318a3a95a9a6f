"""Trackers, lineage, `kiln runs`, `kiln plot`, `kiln eval` on real training runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_job
from kiln.checkpoint.hf_export import export_hf
from kiln.checkpoint.storage import Storage
from kiln.cli import main
from kiln.tracking import Trackers
from kiln.tracking.best import BestCheckpoint
from kiln.tracking.jsonl import read_metrics, series
from kiln.tracking.lineage import chain, read_lineage
from kiln.train.trainer import train

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def short_job(tmp_path, name: str, **sections):
    train_cfg = {**dict(max_steps=10, log_interval=2, eval_interval=5, sample_tokens=0),
                 **sections.pop("train", {})}
    return tiny_job(tmp_path, name=name, train=train_cfg, checkpoint=dict(interval=5), **sections)


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real runs (different learning rates) with TensorBoard on."""
    tmp = tmp_path_factory.mktemp("runs")
    cfgs = []
    for name, lr in (("a", 1e-2), ("b", 3e-3)):
        cfg = short_job(tmp, name, optim=dict(lr=lr), tracking=dict(tensorboard=True))
        train(cfg)
        cfgs.append(cfg)
    return cfgs


def test_tensorboard_events_read_back_equal_metrics_jsonl(two_runs):
    cfg = two_runs[0]
    events = scalars(cfg.run_dir)
    records = read_metrics(cfg.run_dir)
    for key in ("loss", "lr", "grad_norm", "val_loss", "tokens_by_source/stdlib"):
        if "/" in key:
            steps = [r["step"] for r in records if "tokens_by_source" in r]
            expected = [float(r["tokens_by_source"]["stdlib"]) for r in records if "tokens_by_source" in r]
        else:
            steps, expected = series(records, key)
        assert len(expected) >= 2 or key.startswith("tokens"), key
        got = events[key]
        assert [s for s, _ in got] == steps, key
        # Event files hold float32.
        np.testing.assert_allclose([v for _, v in got], expected, rtol=1e-6, err_msg=key)


def test_tensorboard_resume_replaces_points_after_the_checkpoint(tmp_path):
    cfg = short_job(tmp_path, "r", tracking=dict(tensorboard=True))
    cfg.run_dir.mkdir(parents=True)
    first = Trackers.open(cfg, cfg.run_dir, 0, resumed_step=0)
    for step in range(0, 9, 2):
        first.log({"step": step, "loss": 10.0 + step})
    first.close()  # as if the run died at step 8 with its last checkpoint at step 4
    second = Trackers.open(cfg, cfg.run_dir, 0, resumed_step=4)
    for step in range(6, 13, 2):
        second.log({"step": step, "loss": 100.0 + step})
    second.close()
    assert scalars(cfg.run_dir)["loss"] == [(0, 10.0), (2, 12.0), (4, 14.0), (6, 106.0),
                                            (8, 108.0), (10, 110.0), (12, 112.0)]


def test_lineage_of_a_fine_tune_names_its_parent_run(two_runs, tmp_path):
    base = two_runs[0]
    lineage = read_lineage(base.run_dir)
    manifest = base.run_dir / "data" / "stdlib-train" / "manifest.json"
    assert lineage["data"][0]["manifest_sha256"] == __import__("hashlib").sha256(
        manifest.read_bytes()).hexdigest()
    assert lineage["tokenizer_fingerprint"] == json.loads(manifest.read_text())["tokenizer"]["fingerprint"]
    assert [c["step"] for c in lineage["checkpoints"] if c["kept"]] == [5, 10]
    assert "git_commit" in lineage["code"] and isinstance(lineage["code"]["git_dirty"], bool)

    export = tmp_path / "export"
    assert main(["export-hf", str(base.run_dir), str(export), "--dtype", "fp32"]) == 0
    exported = read_lineage(export)
    assert exported["kind"] == "kiln-export" and exported["step"] == 10
    assert exported["run"]["name"] == "a"
    assert read_lineage(base.run_dir)["exports"][0]["path"] == str(export.resolve())

    tune = short_job(tmp_path, "tune", model=dict(init_from=str(export)),
                     train=dict(max_steps=4), optim=dict(lr=1e-3))
    train(tune)
    names = [(n["kind"], n.get("name")) for n in chain(tune.run_dir)]
    assert names == [("kiln-run", "tune"), ("kiln-export", None), ("kiln-run", "a")]
    assert read_lineage(tune.run_dir)["parent"]["path"] == str(export.resolve())


def test_kiln_lineage_and_runs_commands(two_runs, tmp_path, capsys):
    a, b = two_runs
    assert main(["lineage", str(a.run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run a (") and "config " in out and "checkpoints [5, 10]" in out
    assert main(["runs", str(a.run_dir.parent)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["name", "status", "steps", "tokens"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    best_a = min(series(read_metrics(a.run_dir), "val_loss")[1])
    assert rows["a"][1:4] == ["finished", "10", "5,120"] and rows["a"][4] == f"{best_a:.4f}"
    assert rows["b"][1] == "finished"


def test_kiln_plot_two_runs_draws_a_readable_png(two_runs, tmp_path):
    import matplotlib.image

    out = tmp_path / "curves.png"
    assert main(["plot", str(two_runs[0].run_dir), str(two_runs[1].run_dir), "--out", str(out)]) == 0
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 1200
    # Not blank: many distinct colours (two runs' lines, text) and much non-white area.
    rgb = (image[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 200
    assert (rgb.min(axis=1) < 200).mean() > 0.02


def test_kiln_eval_on_a_run_scores_tasks_and_reports_to_its_trackers(two_runs, tmp_path, capsys):
    cfg = two_runs[1]
    task = tmp_path / "mini.jsonl"
    task.write_text("\n".join(json.dumps(x) for x in [
        {"question": "def", "choices": ["f(x):", "return"], "answer": 0},
        {"prompt": "import", "answer": "os"},
        {"text": "def add(a, b):\n    return a + b\n"},
    ]) + "\n")
    assert main(["eval", str(cfg.run_dir), "--task", str(task), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    last = read_metrics(cfg.run_dir)[-1]
    assert last["step"] == 10
    assert set(last) == {"step", "eval/mini/acc", "eval/mini/acc_norm", "eval/mini/acc_bytes",
                         "eval/mini/exact_match", "eval/mini/contains", "eval/mini/loss",
                         "eval/mini/ppl", "eval/mini/tokens"}
    assert math.isclose(last["eval/mini/ppl"], math.exp(last["eval/mini/loss"]), rel_tol=1e-4)
    assert "eval/mini/loss" in out
    events = scalars(cfg.run_dir)
    assert events["eval/mini/loss"] == [(10, pytest.approx(last["eval/mini/loss"], rel=1e-6))]


def test_best_checkpoint_is_recorded_and_kept_by_retention(tmp_path):
    storage = Storage(str(tmp_path / "checkpoints"))
    best = BestCheckpoint(tmp_path, "val_loss", "min")
    losses = {10: 3.0, 20: 2.0, 30: 2.5, 40: 2.7, 50: 2.9}
    for step, loss in losses.items():
        storage.prepare(step)
        storage.write_text(step, "weights", f"step {step}")
        storage.commit(step, {})
        best.observe({"step": step, "val_loss": loss, "val_ppl": math.exp(loss)})
        chosen = best.select([c.step for c in storage.committed()])
        storage.apply_retention(step, keep_last=2, keep_every=None, keep={chosen})
    assert [c.step for c in storage.committed()] == [20, 40, 50]
    saved = json.loads((tmp_path / "best.json").read_text())
    assert (saved["step"], saved["value"]) == (20, 2.0)
    # It survives a resume: a new process reading best.json still picks step 20.
    assert BestCheckpoint(tmp_path).select([20, 40, 50]) == 20
