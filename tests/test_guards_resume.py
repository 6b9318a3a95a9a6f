"""The bad-step guard's state (spike window, bad steps, batches to skip) travels in every
checkpoint: a restarted run takes the decisions an uninterrupted one takes, and bad steps
counted before a restart still count toward guards.max_bad_steps. One process, in this one;
the loss spikes come from tests/workers/kiln_faults.py's hook (loss and gradients x50)."""

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from conftest import ROOT, tiny_job
from kiln.checkpoint.storage import Storage
from kiln.errors import KilnError, Preempted
from kiln.train.trainer import Trainer, train

_spec = importlib.util.spec_from_file_location("kiln_faults", ROOT / "tests/workers/kiln_faults.py")
kiln_faults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kiln_faults)  # defines the hooks; installs none without its env
PLAIN = Trainer.forward_backward


def job(directory: Path, name: str, steps: int, async_save: bool = False, **guards):
    return tiny_job(directory, name=name, train={
        "micro_batch_size": 8, "max_steps": steps, "log_interval": 1, "eval_interval": 1000,
        "sample_tokens": 0, "num_threads": 1},
        checkpoint={"interval": 5, "keep_last": None, "async": async_save},
        guards={"skip_bad_steps": True, "spike_window": 8, "spike_min_history": 5, **guards})


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def decisions(run_dir: Path) -> list[tuple]:
    """Each logged step's loss and bad-step count, and each rollback, in the order they came."""
    return [(r["step"], r["loss"], r["bad_steps"]) if "loss" in r else r
            for r in records(run_dir) if "loss" in r or "rolled_back_to" in r]


def spikes(monkeypatch, steps: set[int], term_at: tuple[int, int] | None = None) -> None:
    """The spike hook; term_at=(step, n): SIGTERM to this process the n-th time that step runs
    (the preemption path: checkpoint at the step boundary, then Preempted)."""
    spiking = kiln_faults.spiking(PLAIN, steps)
    seen: dict[int, int] = {}

    def hooked(self, batches):
        seen[self.step + 1] = seen.get(self.step + 1, 0) + 1
        if term_at is not None and (self.step + 1, seen[self.step + 1]) == term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return spiking(self, batches)

    monkeypatch.setattr(Trainer, "forward_backward", hooked)


def test_a_run_preempted_during_a_rollback_replay_resumes_with_the_same_decisions(tmp_path, monkeypatch):
    # Steps 9 and 10 spike: a rollback (2 in a row) to the checkpoint of step 5, skipping
    # those batches on the replay; step 16 spikes alone and is skipped against the window.
    guards = {"rollback_after": 2}
    spikes(monkeypatch, {9, 10, 16})
    straight = job(tmp_path, "straight", 20, **guards)
    train(straight)
    want = decisions(straight.run_dir)
    assert {"step": 9, "rolled_back_to": 5, "skipping_steps": [9, 10]} in want
    assert [d[0] for d in want if isinstance(d, tuple)] == (
        list(range(1, 10)) + list(range(6, 9)) + list(range(11, 21)))  # 9, 10 not trained twice
    assert want[-1][2] == 3  # 9, 10 and 16, each once

    # The same run, preempted while it replays step 7 (after the rollback, before the batches
    # it must skip): the checkpoint of step 7 must carry the skip list, window and count. Saved
    # in the background, into buffers reused from step 5's save: the guard's state of step 7.
    spikes(monkeypatch, {9, 10, 16}, term_at=(7, 2))
    stopped = job(tmp_path, "stopped", 20, async_save=True, **guards)
    with pytest.raises(Preempted):
        train(stopped)
    assert [c.step for c in Storage(str(stopped.run_dir / "checkpoints")).committed()] == [5, 7]
    spikes(monkeypatch, {9, 10, 16})
    resumed = train(stopped)
    assert resumed.start_step == 7 and resumed.steps == 20
    assert decisions(stopped.run_dir) == want
    a, b = load_file(straight.run_dir / "model.safetensors"), load_file(stopped.run_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_steps_before_a_restart_count_toward_max_bad_steps_after_it(tmp_path, monkeypatch):
    spikes(monkeypatch, {7, 8, 14})
    guards = {"rollback_after": None, "max_bad_steps": 2}
    first = job(tmp_path, "run", 10, **guards)
    assert train(first).steps == 10  # 7 and 8 skipped: 2 bad steps are allowed
    assert [r["bad_steps"] for r in records(first.run_dir) if "loss" in r][-1] == 2
    # The restart (a longer budget) meets one more: 3 in all, over the limit, and the message
    # names every one with its data position, also those from before the restart.
    with pytest.raises(KilnError, match="max_bad_steps=2") as stop:
        train(job(tmp_path, "run", 20, **guards))
    message = str(stop.value)
    assert message.startswith("3 bad steps")
    for step in (7, 8, 14):
        assert f"step {step}: loss spike" in message
    assert message.count("data position") == 3
    assert max(r["step"] for r in records(first.run_dir) if "loss" in r) == 13


def test_checkpoints_without_guard_state_still_resume_and_guards_can_be_turned_off(tmp_path):
    def saved_keys(cfg, step: int) -> set[str]:
        (committed,) = [c for c in Storage(str(cfg.run_dir / "checkpoints")).committed() if c.step == step]
        return set(FileSystemReader(committed.url).read_metadata().state_dict_metadata)

    # Saved without guards (as an older kiln saved every checkpoint): a fresh guard takes over.
    plain = job(tmp_path, "run", 4, skip_bad_steps=False)
    train(plain)
    assert "train.step" in saved_keys(plain, 4) and "train.guard" not in saved_keys(plain, 4)
    with_guard = job(tmp_path, "run", 8)
    assert train(with_guard).start_step == 4
    assert records(with_guard.run_dir)[-3]["bad_steps"] == 0
    assert "train.guard" in saved_keys(with_guard, 8)
    # ... and a checkpoint with guard state resumes in a run without guards.
    result = train(job(tmp_path, "run", 10, skip_bad_steps=False))
    assert result.start_step == 8 and result.steps == 10
