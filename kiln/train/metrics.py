"""Throughput, MFU, memory, and the metrics log: metrics.jsonl plus a progress bar or plain lines."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from kiln.models.moe import load_balancing_loss, moe_layers, router_z_loss

# Dense bf16 peaks (TFLOP/s) of known accelerators, by a substring of the device name.
KNOWN_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "MI300X": 1307.4, "MI325X": 1307.4}


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n-cubed matmul on the CPU with the current thread count (best of repeats)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float | None) -> float:
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in KNOWN_PEAK_TFLOPS.items():
            if key in name:
                return tflops * 1e12
        return 312e12  # A100 bf16, a conservative default for unknown GPUs
    return measure_matmul_flops(dtype)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # VmHWM is this process's own peak; ru_maxrss also counts the parent's when started by
    # fork and exec (a launcher, a test runner, a benchmark), which can exceed ours.
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def moe_metrics(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """A mixture of experts' figures for the log line ({} for a dense model); reads the device
    (one sync), so call it at log intervals only.

    moe/load/<layer>: the busiest expert's tokens over the mean (1.0 = balanced), counted over
    the training micro-batches since the last call (summed over `group`, the data-parallel
    ranks), then reset; moe/load_max: the largest of them. moe/aux_loss and moe/z_loss: the
    unweighted load-balancing loss and router z-loss of the last micro-batch (the logged loss
    includes them times their coefficients). moe/bias_min, moe/bias_max: the routing biases'
    range, with moe.bias_update_rate.
    """
    layers = moe_layers(model)
    if not layers:
        return {}
    loads = torch.stack([m.load_window for m in layers.values()])
    if group is not None:
        dist.all_reduce(loads, group=group)
    loads = loads.float()
    figures = {f"moe/load/{name.removeprefix('layers.').removesuffix('.mlp')}": ratio
               for name, ratio in zip(layers, loads.max(1).values / loads.mean(1).clamp(min=1e-9))}
    for m in layers.values():
        m.load_window.zero_()
    stats = [m.stats for m in layers.values() if m.stats is not None]
    if stats:
        with torch.no_grad():
            figures.update({"moe/aux_loss": load_balancing_loss(stats),
                            "moe/z_loss": router_z_loss(stats)})
    biases = [m.expert_bias for m in layers.values() if m.expert_bias is not None]
    if biases:
        figures.update({"moe/bias_min": torch.stack(biases).min(), "moe/bias_max": torch.stack(biases).max()})
    values = torch.stack([v.float().reshape(()) for v in figures.values()]).tolist()  # the one sync
    record = dict(zip(figures, values))
    record["moe/load_max"] = max(v for k, v in record.items() if k.startswith("moe/load/"))
    return record


class MetricsLog:
    """Appends one JSON object per logging interval to metrics.jsonl and shows it."""

    def __init__(self, path: Path, total_steps: int | None, progress_bar: str, start_step: int = 0):
        self.path = path
        show_bar = progress_bar == "on" or (progress_bar == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True) if show_bar else None

    def log(self, record: dict) -> None:
        record = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        line = " ".join(f"{k}={_fmt(v)}" for k, v in record.items())
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.3f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
