"""Throughput, MFU and memory figures (the metrics log itself is kiln/tracking/jsonl.py)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import torch

from kiln.tracking.jsonl import MetricsLog  # noqa: F401 (moved; the trainer imports it from here)

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
