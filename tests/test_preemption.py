"""SIGTERM checkpoints at the next step boundary and exits 75 ("restart me"); the resumed run
continues with the losses of an uninterrupted one. Bad steps are skipped when guards say so."""

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

import kiln.train.trainer as trainer_module
from conftest import ROOT, tiny_job
from kiln.checkpoint.storage import Storage
from kiln.train.trainer import train


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def test_sigterm_saves_at_the_step_boundary_and_the_resumed_run_matches(tmp_path):
    job = tiny_job(tmp_path, train={"max_steps": 40, "log_interval": 1, "eval_interval": 1000,
                                    "sample_tokens": 0}, checkpoint={"interval": None})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(job.to_yaml())
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "train", str(job_file)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = job.run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(losses(job.run_dir)) >= 5:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 75, output[-3000:]
    assert "Traceback" not in output
    (committed,) = Storage(str(job.run_dir / "checkpoints")).committed()
    stopped = committed.step
    assert 5 <= stopped < 40 and max(losses(job.run_dir)) == stopped  # saved where it stopped

    resumed = train(job)  # --resume auto picks it up
    assert resumed.start_step == stopped and resumed.steps == 40
    straight = train(tiny_job(tmp_path / "straight", train={
        "max_steps": 40, "log_interval": 1, "eval_interval": 1000, "sample_tokens": 0},
        checkpoint={"interval": None}))
    got = losses(job.run_dir)
    assert [got[s] for s in range(1, 41)] == [round(x, 6) for x in straight.losses]  # as logged


def test_a_non_finite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    plain = trainer_module.forward_backward
    calls = []

    def poisoned(model, *args, **kwargs):  # the test hook: NaN gradients on the 4th step
        loss = plain(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:
            next(p for p in model.parameters() if p.grad is not None).grad.fill_(float("nan"))
        return loss

    monkeypatch.setattr(trainer_module, "forward_backward", poisoned)
    cfg = tiny_job(tmp_path, train={"max_steps": 10, "log_interval": 5, "sample_tokens": 0},
                   guards={"skip_bad_steps": True})
    result = train(cfg)
    assert result.steps == 10
    weights = load_file(cfg.run_dir / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["bad_steps"] for r in records if "bad_steps" in r] == [1, 1]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r and r["step"] != 4)
