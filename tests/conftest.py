import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.config import JobConfig


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu.sh runs these on a GPU)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


def tiny_job(tmp_path, **sections) -> JobConfig:
    """A job small enough to train in seconds: a 2-layer model on a slice of the stdlib corpus."""
    raw = {
        "name": "t", "out_dir": str(tmp_path / "runs"),
        "model": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=160, max_seq_len=64),
        # val_fraction 0.15: 32 validation sequences from this slice (0.1 held out one file, a
        # single 32-token sequence, so validation loss was mostly noise)
        "data": dict(seq_len=32, max_bytes=400_000, val_fraction=0.15),
        "optim": dict(lr=1e-2),
        "schedule": dict(warmup_steps=5),
        "train": dict(micro_batch_size=16, max_steps=60, log_interval=20, eval_interval=30,
                      eval_batches=2, sample_tokens=8, num_threads=2),
        "metrics": dict(peak_tflops=0.1, progress_bar="off"),
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return JobConfig.model_validate(raw)


ROOT = Path(__file__).resolve().parents[1]


def start(cmd: list[str], cwd: Path = ROOT) -> subprocess.Popen:
    """Start a launcher (torchrun, `kiln train --nproc`) in a session of its own, so a hang or a
    failure is cleaned up whole (no workers left behind); one thread per process."""
    return subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    """Wait for a started launcher: (exit code, output); the test fails if it runs past timeout."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} timed out after {timeout} s:\n{output[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def failure(output: str) -> str:
    """The part of a failed launch's output worth reading: the first traceback and the end."""
    first = output.find("Traceback")
    head = output[first:first + 5000] if first >= 0 else ""
    return f"{head}\n...\n{output[-2500:]}"


def torchrun(args: list[str], nproc: int = 2, timeout: float = 240, extra: list[str] = ()) -> str:
    """Run `torchrun --standalone --nproc-per-node nproc ARGS` from the repo root; its output.
    Fails the test with the output's first traceback and tail on a non-zero exit."""
    code, output = finish(start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", *extra, *args]), timeout)
    assert code == 0, failure(output)
    return output
