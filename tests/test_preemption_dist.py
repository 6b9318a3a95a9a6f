"""Preemption and restarts of a 2-process `kiln train` under real torchrun (gloo, CPU):

- SIGTERM to torchrun (what Kubernetes sends the container's main process on eviction or Kueue
  preemption) at a random step: torchrun forwards it, both ranks agree at the next step
  boundary, commit a checkpoint there and exit with the restart status 75; resuming gives the
  losses of an uninterrupted run.
- SIGKILL to one worker under `torchrun --max-restarts 1`: torchrun restarts both workers, they
  resume from the newest committed checkpoint by themselves (`--resume auto`, the default) and
  the run ends with the final weights of an uninterrupted run, tensor for tensor.

The random step comes from a seeded RNG: KILN_TEST_SEED replays a failure (the seed is in every
assertion message)."""

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, failure, finish, start, tiny_job, torchrun
from kiln.checkpoint.storage import Storage

SEED = int(os.environ.get("KILN_TEST_SEED", time.time_ns() % 1_000_000))
FAULTS = str(ROOT / "tests/workers/kiln_faults.py")
STEPS = 60


def write_job(directory: Path, name: str = "t") -> Path:
    """60 steps of a 2-layer model (a step takes ~50 ms: start-up dominates), a checkpoint every
    4 steps, all of them kept, every step's loss logged."""
    cfg = tiny_job(directory, name=name, train={
        "micro_batch_size": 8, "max_steps": STEPS, "log_interval": 1, "eval_interval": 1000,
        "sample_tokens": 0, "num_threads": 1}, checkpoint={"interval": 4, "keep_last": None})
    path = directory / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step; a step run twice (before and after a resume) must agree."""
    seen: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            step = record["step"]
            assert seen.setdefault(step, record["loss"]) == record["loss"], f"step {step} differs"
    return seen


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_for_step(run_dir: Path, proc, step: int, timeout: float = 180) -> None:
    """Until the log shows `step` (polled every 20 ms: a step takes ~50 ms)."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {step} (seed {SEED}):\n"
                        f"{failure(proc.communicate()[0])}")
        if metrics.exists() and max(losses(run_dir), default=0) >= step:
            return
        time.sleep(0.02)
    pytest.fail(f"no step {step} within {timeout} s (seed {SEED})")


def launch(job: Path, *extra: str):
    return start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node=2", *extra, FAULTS, "train", str(job)])


def exits(path: Path) -> list[str]:
    return sorted(path.read_text().splitlines()) if path.exists() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job on 2 processes, uninterrupted: its losses and final weights."""
    directory = tmp_path_factory.mktemp("reference")
    torchrun(["-m", "kiln", "train", str(write_job(directory))])
    run_dir = directory / "runs" / "t"
    return losses(run_dir), load_file(run_dir / "model.safetensors")


def test_sigterm_to_torchrun_commits_at_the_step_boundary_exits_75_and_resumes_same_losses(
        reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_FAULT_EXITS", str(tmp_path / "exits.txt"))
    at = random.Random(SEED).randint(5, 30)
    job, run_dir = write_job(tmp_path), tmp_path / "runs" / "t"
    proc = launch(job)
    wait_for_step(run_dir, proc, at)
    os.kill(proc.pid, signal.SIGTERM)  # torchrun, which forwards it to its workers
    code, output = finish(proc)
    why = f"(seed {SEED}, signalled at step {at}):\n{failure(output)}"
    # Both workers took the clean way out: the checkpoint, then "restart me". (torchrun itself
    # reports the signal it got with a non-zero status of its own.)
    assert exits(tmp_path / "exits.txt") == ["rank 0 restart 0 exit 75",
                                             "rank 1 restart 0 exit 75"], why
    assert code != 0 and output.count("kiln: stopped: SIGTERM: checkpoint of step") == 2, why
    stopped = max(losses(run_dir))
    assert at <= stopped < STEPS, why
    assert {"step": stopped, "preempted": "SIGTERM"} in records(run_dir), why
    committed = [c.step for c in Storage(str(run_dir / "checkpoints")).committed()]
    assert committed[-1] == stopped, why  # committed at the boundary it stopped at

    torchrun(["-m", "kiln", "train", str(job)])  # --resume auto is the default
    resumed = [r for r in records(run_dir) if "resumed_from" in r]
    assert [r["step"] for r in resumed] == [stopped], why
    expected, _ = reference
    assert losses(run_dir) == expected, why
    assert sorted(expected) == list(range(1, STEPS + 1))


def test_sigkilled_worker_is_restarted_by_torchrun_and_ends_with_the_same_weights(
        reference, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_FAULT_EXITS", str(tmp_path / "exits.txt"))
    monkeypatch.setenv("KILN_FAULT_PIDS", str(tmp_path / "pids"))
    at = random.Random(SEED + 1).randint(6, 30)
    job, run_dir = write_job(tmp_path), tmp_path / "runs" / "t"
    proc = launch(job, "--max-restarts=1")
    wait_for_step(run_dir, proc, at)
    before = [c.step for c in Storage(str(run_dir / "checkpoints")).committed()]
    pid = int((tmp_path / "pids" / "rank1.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)  # no warning, no handler: a lost node, an OOM kill
    code, output = finish(proc)
    why = f"(seed {SEED + 1}, rank 1 killed at step {at}):\n{failure(output)}"
    assert code == 0, why
    # The survivor, if it noticed before torchrun stopped it, says what happened: not a bug.
    assert "this is a bug in kiln" not in output, why
    # torchrun saw the failure and started both workers again (restart 1), which finished.
    assert "rank 0 restart 1 exit 0" in exits(tmp_path / "exits.txt"), why
    assert "rank 1 restart 1 exit 0" in exits(tmp_path / "exits.txt"), why
    assert (tmp_path / "pids" / "rank1.pid").read_text().split()[1] == "restart1", why
    # It resumed by itself from the newest checkpoint committed before the kill: at most one
    # interval (4 steps) behind the last step the killed attempt logged (the save of that step
    # may have been the one cut short), never a torn one.
    lines = records(run_dir)
    (resumed,) = [i for i, r in enumerate(lines) if "resumed_from" in r]
    last = max(r["step"] for r in lines[:resumed] if "loss" in r)
    step = lines[resumed]["step"]
    assert before and before[-1] <= step and last - 4 <= step <= last and step % 4 == 0, why
    expected_losses, expected = reference
    assert losses(run_dir) == expected_losses, why  # steps run twice agree, and with the reference
    got = load_file(run_dir / "model.safetensors")
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), f"{name} differs {why}"
