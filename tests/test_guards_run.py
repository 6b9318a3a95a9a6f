"""The run guards end to end: `kiln train` on 2 processes under real torchrun (gloo, CPU), with
faults injected by tests/workers/kiln_faults.py (test hooks around kiln's own functions, not a
real bad batch). (A NaN gradient skipped in one process: tests/test_preemption.py; the guards'
decisions on their own: tests/test_guards.py.)

- A loss spike (steps 12 and 13, loss and gradients x50) is skipped; with rollback_after=2 the
  run rolls back to the checkpoint of step 10 and skips those batches on the replay. Both end
  with finite weights, and with the same weights: skipping a step and rolling back over it both
  leave out exactly those two batches.
- A step that hangs on rank 0: both ranks' hang watchdogs dump their Python stacks (rank 0's
  names the hung function, rank 1's the collective it waits in) and exit with the restart
  status."""

import json
import math
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from conftest import ROOT, failure, finish, start, tiny_job, torchrun

FAULTS = str(ROOT / "tests/workers/kiln_faults.py")


def write_job(directory: Path, name: str, steps: int, **guards) -> Path:
    cfg = tiny_job(directory, name=name, train={
        "micro_batch_size": 8, "max_steps": steps, "log_interval": 1, "eval_interval": 1000,
        "sample_tokens": 0, "num_threads": 1}, checkpoint={"interval": 5, "keep_last": None},
        guards=guards)
    path = directory / f"{name}.yaml"
    path.write_text(cfg.to_yaml())
    return path


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def finite_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    weights = load_file(run_dir / "model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    return weights


def test_loss_spike_is_skipped_or_rolled_back_past_and_the_run_ends_finite(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_FAULT_SPIKE", "12,13")
    # A short window (5 steps) so the spike test is armed early; the default k = 6.
    guards = {"skip_bad_steps": True, "spike_window": 20, "spike_min_history": 5}
    torchrun([FAULTS, "train", str(write_job(tmp_path, "skip", 20, rollback_after=None, **guards))])
    skip_dir = tmp_path / "runs" / "skip"
    lines = records(skip_dir)
    loss = {r["step"]: r["loss"] for r in lines if "loss" in r}
    assert sorted(loss) == list(range(1, 21))
    assert loss[12] > 20 * loss[11] and loss[13] > 20 * loss[11]  # the injected spike, as logged
    assert all(math.isfinite(v) and v < 2 * loss[1] for s, v in loss.items() if s not in (12, 13))
    assert [r["bad_steps"] for r in lines if "loss" in r][-1] == 2
    assert not any("rolled_back_to" in r for r in lines)
    skipped = finite_weights(skip_dir)

    torchrun([FAULTS, "train", str(write_job(tmp_path, "rollback", 20, rollback_after=2, **guards))])
    roll_dir = tmp_path / "runs" / "rollback"
    lines = records(roll_dir)
    (back,) = [r for r in lines if "rolled_back_to" in r]
    assert back == {"step": 12, "rolled_back_to": 10, "skipping_steps": [12, 13]}
    # Step 11 ran twice (before the spike and on the replay) with the same loss; 12 and 13 were
    # read on the replay but not trained on, so nothing is logged for them after the rollback.
    after = [r for r in lines[lines.index(back):] if "loss" in r]
    assert [r["step"] for r in after] == [11] + list(range(14, 21))
    assert after[0]["loss"] == next(r["loss"] for r in lines if r.get("step") == 11 and "loss" in r)
    assert after[-1]["bad_steps"] == 2  # each bad step counted once, the replay's skips too
    rolled = finite_weights(roll_dir)
    assert rolled.keys() == skipped.keys()
    for name, tensor in skipped.items():
        assert torch.equal(rolled[name], tensor), name


def test_hung_step_dumps_every_rank_stack_and_exits_for_a_restart(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_FAULT_HANG", "6")  # rank 0 blocks at the start of step 6
    # A hang: no step for 10 x the median step time, at least 1 s; exit after 6 s without one.
    job = write_job(tmp_path, "hang", 40, hang_min_seconds=1.0, hang_exit_after=6.0)
    logs = tmp_path / "logs"
    code, output = finish(start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", f"--log-dir={logs}", "--redirects=2",
                                 FAULTS, "train", str(job)]), timeout=240)
    stderr = {rank: next(logs.glob(f"*/attempt_0/{rank}/stderr.log")).read_text()
              for rank in (0, 1)}
    why = failure(output) + "\n" + "\n".join(f"rank {r}:\n{t[-3000:]}" for r, t in stderr.items())
    assert code != 0, why
    # The first rank whose watchdog ran out exited with the restart status (torchrun's summary
    # of the failure); rank 0's own log says it did so (whichever of the two was first).
    assert re.search(r"exitcode\s*: 75\b", output), why
    first, last = stderr[0].split("kiln: hang watchdog (")[1:3]
    assert first.startswith("pid") and "rank 0): no step finished for" in first, why
    assert "in injected_hang" in first and "in hanging_train_step" in first, why
    assert "exiting with status 75" in last and "in injected_hang" in last, why
    # rank 1 was not hung itself: its dump shows it waiting for rank 0 in a collective.
    dump = stderr[1].split("kiln: hang watchdog (")[1]
    assert "rank 1): no step finished for" in dump and "in forward_backward" in dump, why
    assert max((r["step"] for r in records(tmp_path / "runs" / "hang") if "loss" in r)) == 5
