"""Launching real torchrun processes from tests: a timeout, and the whole process group killed
on failure so no worker outlives its test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(args: list[str], timeout: float = 240, cwd: Path = ROOT,
             launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run `python -m torch.distributed.run ARGS` (or `launcher ARGS`) in a session of its own;
    returns the finished process with its combined output. One thread per process: the tests
    run several ranks on two cores."""
    cmd = launcher or [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*cmd, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd + args)} ran past {timeout} s:\n{output[-4000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def failure(output: str) -> str:
    """The part of a failed launch's output worth reading: the first traceback and the end."""
    first = output.find("Traceback")
    head = output[first:first + 5000] if first >= 0 else ""
    return f"{head}\n...\n{output[-2500:]}"
