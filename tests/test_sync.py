"""No host-device sync in the training step: loss, token counts and the gradient norm stay on
the device and are read once per log interval.

On a CPU nothing stalls, so the test counts the Python-level reads that would be syncs on a
GPU (Tensor.item, tolist, bool/float/int of a tensor, .cpu()) during two real runs that differ
only in their number of steps: the extra steps may add reads per log interval, not per step.
(Before the trainer reshape this counted 3 reads per step.)
"""

import collections

import torch

from conftest import tiny_job
from kiln.train.trainer import train

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")
LOG_INTERVAL = 10
# Per log line: loss, grad norm, token count, maybe a couple more; generous on purpose.
READS_PER_LOG = 6


def count_reads(tmp_path, monkeypatch, steps: int) -> collections.Counter:
    counts = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    cfg = tiny_job(tmp_path / str(steps),
                   train={"max_steps": steps, "log_interval": LOG_INTERVAL,
                          "eval_interval": 1000, "sample_tokens": 0})
    try:
        train(cfg)
    finally:
        monkeypatch.undo()
    return counts


def test_step_reads_device_values_once_per_log_interval(tmp_path, monkeypatch):
    short = count_reads(tmp_path, monkeypatch, LOG_INTERVAL)
    long = count_reads(tmp_path, monkeypatch, 3 * LOG_INTERVAL)
    extra = sum(long.values()) - sum(short.values())
    extra_logs = 2
    assert extra <= READS_PER_LOG * extra_logs, (
        f"{extra} more host reads over {2 * LOG_INTERVAL} more steps ({long - short}): "
        f"expected at most {READS_PER_LOG} per log line")
