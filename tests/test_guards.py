"""The run guards (kiln/train/guards.py) on their own: skip/rollback/stop decisions, signals that
only raise a flag (and that all ranks agree on), and a watchdog that dumps the stacks of a hung
process and ends it with the restart status."""

import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import torchrun
from kiln.config import GuardsConfig
from kiln.errors import KilnError
from kiln.train.guards import (EXIT_RESTART, Action, HangWatchdog, PreemptionFlag, StepGuard,
                               all_ranks_agree)

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def warmed(guard: StepGuard, steps: int = 30) -> StepGuard:
    rng = random.Random(0)
    for step in range(1, steps + 1):
        assert guard.check(step, 3.0 + rng.uniform(-0.05, 0.05), 1.0) is Action.APPLY
    return guard


def test_spike_and_non_finite_steps_are_skipped_and_recorded():
    guard = warmed(StepGuard(window=50, k=6.0, min_history=20, rollback_after=None))
    limit = guard.spike_threshold()
    assert 3.0 < limit < 3.5
    assert guard.check(31, 9.0, 1.0, position={"epoch": 0, "index": 31}) is Action.SKIP
    assert guard.check(32, math.nan, 1.0) is Action.SKIP
    assert guard.check(33, 3.0, math.inf) is Action.SKIP
    assert guard.check(34, 3.01, 1.0) is Action.APPLY
    assert guard.spike_threshold() == pytest.approx(limit, rel=0.01)  # bad losses not in window
    assert [(b.step, b.reason.split(" (")[0]) for b in guard.bad_steps] == [
        (31, "loss spike"), (32, "non-finite loss"), (33, "non-finite gradient norm")]
    assert guard.bad_steps[0].position == {"epoch": 0, "index": 31}


def test_no_spike_verdict_before_the_window_fills():
    guard = StepGuard(window=50, min_history=20)
    for step in range(1, 20):
        assert guard.check(step, 10.0 / step, 1.0) is Action.APPLY  # a falling early loss
    assert guard.spike_threshold() is None


def test_bad_streak_asks_for_rollback_and_replay_skips_those_batches():
    guard = warmed(StepGuard(window=50, min_history=20, rollback_after=3))
    assert guard.check(31, 50.0, 1.0) is Action.SKIP
    assert guard.check(32, 60.0, 1.0) is Action.SKIP
    assert guard.check(33, 70.0, 1.0) is Action.ROLLBACK
    skip = guard.rolled_back(to_step=25)  # the last checkpoint was at step 25
    assert skip == {31, 32, 33}
    for step in range(26, 31):  # the replay: good steps go back into the window
        assert not guard.skip_batch(step)
        assert guard.check(step, 3.0, 1.0) is Action.APPLY
    assert all(guard.skip_batch(s) for s in (31, 32, 33)) and not guard.skip_batch(34)
    assert guard.check(34, 3.0, 1.0) is Action.APPLY


def test_too_many_bad_steps_stop_with_steps_and_positions_named():
    guard = warmed(StepGuard(min_history=20, rollback_after=None, max_bad_steps=2))
    guard.check(31, math.nan, 1.0, position="shard 3 offset 1024")
    guard.check(40, math.nan, 1.0, position="shard 3 offset 9000")
    with pytest.raises(KilnError, match=r"3 bad steps .*step 31: non-finite loss \(data position "
                                        r"shard 3 offset 1024\).*step 41"):
        guard.check(41, 99.0, 1.0)


def test_state_dict_round_trip_gives_the_same_decisions():
    a = warmed(StepGuard(min_history=20))
    a.check(31, 50.0, 1.0)
    b = StepGuard(min_history=20)
    b.load_state_dict(a.state_dict())
    assert b.spike_threshold() == a.spike_threshold() and len(b.bad_steps) == 1
    for loss in (3.0, 3.4, 40.0):
        assert a.check(32, loss, 1.0) is b.check(32, loss, 1.0)


def test_state_saved_mid_streak_as_json_still_rolls_back_after_it():
    # A checkpoint can fall between two bad steps of a streak: the restored guard still asks
    # for the rollback the uninterrupted run takes. (Older checkpoints have no streak.)
    a = warmed(StepGuard(min_history=20, rollback_after=2))
    assert a.check(31, math.nan, 1.0, position={"position": 64}) is Action.SKIP
    saved = json.loads(json.dumps(a.state_dict()))  # as a checkpoint holds it
    b = StepGuard(min_history=20, rollback_after=2)
    b.load_state_dict(saved)
    assert json.dumps(b.state_dict()) == json.dumps(a.state_dict())  # NaN != NaN: as text
    assert b.check(32, math.inf, 1.0) is a.check(32, math.inf, 1.0) is Action.ROLLBACK
    c = StepGuard(min_history=20, rollback_after=2)
    c.load_state_dict({k: v for k, v in saved.items() if k != "streak"})
    assert c.check(32, math.inf, 1.0) is Action.SKIP and len(c.bad_steps) == 2


def test_built_from_the_job_config():
    cfg = GuardsConfig(spike_k=3.0, spike_window=40, rollback_after=None,
                       preemption_signals=["SIGUSR2"], hang_factor=5.0, hang_exit_after=None)
    # A window of +-0.05 noise (std ~0.03): 3.15 is a spike at k=3, not at the default k=6.
    assert warmed(StepGuard.from_config(cfg)).check(31, 3.15, 1.0) is Action.SKIP
    assert warmed(StepGuard.from_config(GuardsConfig())).check(31, 3.15, 1.0) is Action.APPLY
    assert PreemptionFlag.from_config(cfg).signals == (signal.SIGUSR2,)
    dog = HangWatchdog.from_config(cfg)
    assert (dog.factor, dog.min_seconds, dog.exit_after) == (5.0, 60.0, None)
    with pytest.raises(ValueError, match="spike_min_history=50 exceeds"):
        GuardsConfig(spike_window=40, spike_min_history=50)


def test_signal_sets_flag_and_a_duplicate_is_ignored():
    previous = signal.getsignal(signal.SIGUSR1)
    with PreemptionFlag(repeat_within=60) as flag:
        assert not flag.requested and not flag.should_stop()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # the same notice again: the process lives on
        assert flag.requested and flag.signal_name == "SIGUSR1" and flag.should_stop()
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_a_later_second_signal_ends_the_process():
    child = textwrap.dedent("""
        import os, signal, time
        from kiln.train.guards import PreemptionFlag
        flag = PreemptionFlag(repeat_within=0.2).install()
        os.kill(os.getpid(), signal.SIGTERM)
        print("flag", flag.requested, flush=True)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("still alive", flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert done.returncode == -signal.SIGTERM
    assert "flag True" in done.stdout and "still alive" not in done.stdout
    assert "received again: exiting now" in done.stderr


def test_ranks_agree_on_a_signal_one_of_them_got(tmp_path):
    """2 processes under torchrun (gloo): only rank 1 is signalled; both stop at the same step."""
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent("""
        import os, signal
        import torch.distributed as dist
        from kiln.train.guards import PreemptionFlag, all_ranks_agree
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        flag = PreemptionFlag().install()
        seen = []
        for step in range(1, 6):
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            seen.append(flag.should_stop())
        print(f"rank {rank} {seen} {all_ranks_agree(rank == 0)}", flush=True)
        dist.destroy_process_group()
    """))
    output = torchrun([str(worker)])
    for rank in (0, 1):
        assert f"rank {rank} [False, False, True, True, True] True" in output


def test_all_ranks_agree_without_a_process_group_is_the_local_flag():
    assert all_ranks_agree(True) and not all_ranks_agree(False)


def test_watchdog_dumps_stacks_of_a_slow_step_and_exits_after_the_limit(tmp_path):
    out = (tmp_path / "dump.txt").open("w+")
    exits = []
    dog = HangWatchdog(factor=10, min_seconds=0.3, exit_after=1.5, poll=0.05, out=out,
                       exit=exits.append)
    with dog:
        for _ in range(5):
            time.sleep(0.01)
            dog.beat()
        assert dog.limit() == 0.3  # 10 x ~0.01 s is under the floor
        with dog.paused():  # e.g. a checkpoint save: not a hang
            time.sleep(0.6)
        assert dog.dumps == 0
        time.sleep(0.6)  # a step that hangs
        assert dog.dumps == 1 and not exits
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exits == [EXIT_RESTART] and dog.dumps == 2
    out.seek(0)
    dump = out.read()
    assert "no step finished for" in dump and "exiting with status 75" in dump
    assert "test_watchdog_dumps_stacks_of_a_slow_step" in dump  # the main thread's stack


def test_hung_process_dumps_its_stack_and_exits_with_restart_status():
    child = textwrap.dedent("""
        import threading, time
        from kiln.train.guards import HangWatchdog
        dog = HangWatchdog(min_seconds=0.5, exit_after=2.0, poll=0.1).start()
        def collective_that_never_returns():
            threading.Event().wait()
        for step in range(3):
            time.sleep(0.01)
            dog.beat()
        collective_that_never_returns()
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert done.returncode == EXIT_RESTART and time.monotonic() - start < 30
    assert done.stderr.count("collective_that_never_returns") >= 2  # the first dump and the last
    assert "kiln: hang watchdog" in done.stderr
