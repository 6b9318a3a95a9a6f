"""Throughput, MFU and memory figures (the metrics log itself is kiln/tracking/jsonl.py)."""

from __future__ import annotations

import json
import os
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kiln.tracking.jsonl import MetricsLog  # noqa: F401 (moved; kept importable from here)
from kiln.models.moe import load_balancing_loss, moe_layers, pool_routing, router_z_loss
from kiln.train.precision import cpu_model_name


@dataclass(frozen=True)
class PeakSpec:
    """Dense (no sparsity) peak TFLOP/s of one accelerator, per dtype; None: not supported."""

    bf16: float | None
    fp8: float | None
    tf32: float | None
    fp32: float
    fp16: float | None = None
    """None: the same as bf16."""


# Vendor datasheet figures, dense; matched in order against torch.cuda.get_device_name(), so
# longer names come first (H100 NVL before H100, A100 before A10, MI250X before MI250).
# fp16/bf16 are with fp32 accumulation, as PyTorch runs them.
KNOWN_PEAKS: list[tuple[str, PeakSpec]] = [
    (r"GB200", PeakSpec(bf16=2500, fp8=5000, tf32=1250, fp32=80)),
    (r"B200", PeakSpec(bf16=2250, fp8=4500, tf32=1125, fp32=75)),
    (r"H200 NVL", PeakSpec(bf16=835.5, fp8=1671, tf32=417.5, fp32=60)),
    (r"H200", PeakSpec(bf16=989.4, fp8=1978.9, tf32=494.7, fp32=66.9)),
    (r"H100 NVL", PeakSpec(bf16=835.5, fp8=1671, tf32=417.5, fp32=60)),
    (r"H100 PCIe", PeakSpec(bf16=756, fp8=1513, tf32=378, fp32=51.2)),
    (r"H100", PeakSpec(bf16=989.4, fp8=1978.9, tf32=494.7, fp32=66.9)),  # SXM
    (r"A100", PeakSpec(bf16=312, fp8=None, tf32=156, fp32=19.5)),
    (r"L40S", PeakSpec(bf16=362.05, fp8=733, tf32=183, fp32=91.6)),
    # NVIDIA publishes no A10G sheet: the A10's per-SM rate (125 TFLOP/s over 72 SMs at
    # 1695 MHz) on the A10G's 80 SMs at 1710 MHz, so its MFU is never overstated.
    (r"A10G", PeakSpec(bf16=140, fp8=None, tf32=70, fp32=35)),
    (r"A10\b", PeakSpec(bf16=125, fp8=None, tf32=62.5, fp32=31.2)),
    (r"RTX 4090", PeakSpec(bf16=165.2, fp8=330.3, tf32=82.6, fp32=82.6)),
    # PyTorch sees each of an MI250(X)'s two dies (GCDs) as a device: half the card's figures.
    (r"MI250X", PeakSpec(bf16=191.5, fp8=None, tf32=None, fp32=47.9)),
    (r"MI250", PeakSpec(bf16=181.05, fp8=None, tf32=None, fp32=45.3)),
    (r"MI300A", PeakSpec(bf16=980.6, fp8=1961.2, tf32=490.3, fp32=122.6)),
    (r"MI300X|MI325X", PeakSpec(bf16=1307.4, fp8=2614.9, tf32=653.7, fp32=163.4)),
    (r"V100", PeakSpec(bf16=None, fp8=None, tf32=None, fp32=15.7, fp16=125)),
    (r"T4\b", PeakSpec(bf16=None, fp8=None, tf32=None, fp32=8.1, fp16=65)),
]
_TORCH_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16,
                 "fp16": torch.float16}


@dataclass(frozen=True)
class Peak:
    flops: float
    """FLOP/s."""
    source: str
    """Where the figure comes from, for the start-up line."""


def table_peak_tflops(device_name: str, dtype: str) -> tuple[str, float] | None:
    """(matched name, dense TFLOP/s) of a known accelerator for dtype (fp8/bf16/fp16/tf32/fp32).

    A dtype the device has no tensor cores for runs on its vector units: the fp32 figure.
    """
    for pattern, spec in KNOWN_PEAKS:
        if match := re.search(pattern, device_name):
            figure = {"fp8": spec.fp8, "bf16": spec.bf16, "fp16": spec.fp16 or spec.bf16,
                      "tf32": spec.tf32, "fp32": spec.fp32}[dtype]
            return match.group(0), figure if figure is not None else spec.fp32
    return None


def resolve_peak(device: torch.device, dtype: str, configured_tflops: float | None = None,
                 cache_dir: Path | None = None) -> Peak:
    """The peak the MFU divides by: the dense rate of `dtype`, the dtype the matmuls run in.

    metrics.peak_tflops if set; else a known accelerator's datasheet figure; else measured
    (at most ~2 s) and cached per machine under the user's cache directory. On a CPU the
    measured peak is the faster of `dtype` and fp32: an emulated bf16 matmul can be slower
    than the fp32 ones the same step also runs, and an MFU must never exceed 1.
    """
    device = torch.device(device)
    if configured_tflops is not None:
        return Peak(configured_tflops * 1e12, "metrics.peak_tflops")
    tf32 = torch.get_float32_matmul_precision() != "highest"
    if dtype == "fp32" and device.type == "cuda" and tf32:
        dtype = "tf32"  # fp32 matmuls run on TF32 tensor cores
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = table_peak_tflops(name, dtype)
        if known:
            return Peak(known[1] * 1e12, f"{known[0]} {dtype} dense, datasheet")
        if dtype == "fp8":  # FP8 tensor cores run at twice the bf16 rate on every part that has them
            flops = 2 * cached_measurement(device, "bf16", cache_dir)
            return Peak(flops, f"{name} fp8: 2x its measured bf16 matmul (set metrics.peak_tflops "
                               "to override)")
        flops = cached_measurement(device, dtype, cache_dir)
        return Peak(flops, f"{name} {dtype} matmul, measured (set metrics.peak_tflops to override)")
    flops = cached_measurement(device, dtype, cache_dir)
    label = dtype
    if dtype != "fp32":
        fp32 = cached_measurement(device, "fp32", cache_dir)
        label = dtype if flops >= fp32 else f"fp32 (faster than {dtype} here)"
        flops = max(flops, fp32)
    return Peak(flops, f"CPU {label} matmul, measured")


def peak_flops(device: torch.device, dtype: str | torch.dtype,
               configured_tflops: float | None) -> float:
    """resolve_peak(...).flops; dtype may also be a torch dtype."""
    if isinstance(dtype, torch.dtype):
        dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    return resolve_peak(device, dtype, configured_tflops).flops


def cached_measurement(device: torch.device, dtype: str, cache_dir: Path | None = None) -> float:
    """measure_matmul_flops, cached by (machine, instruction set, threads, torch, dtype).

    The cache keeps the best rate ever measured: other load on the machine only lowers a
    measurement, and a peak measured too low makes an MFU above 1. On a CPU every start also
    measures again, briefly, and a higher figure replaces the cached one; a GPU's is reused.
    """
    path = (cache_dir or default_cache_dir()) / "peak_flops.json"
    key = json.dumps(_machine_key(device, dtype), sort_keys=True)
    cached = None
    try:
        cache = json.loads(path.read_text())
        if isinstance(cache, dict) and isinstance(cache.get(key), dict):
            cached = float(cache[key]["flops"])
    except (OSError, ValueError, KeyError, TypeError):
        cache = {}
    if cached is not None and device.type != "cpu":
        return cached
    flops = measure_matmul_flops(_TORCH_DTYPES[dtype], device)
    if cached is not None and cached >= flops:
        return cached
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:  # a cache that cannot be written (read-only home) only costs a re-measure next time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass
    return flops


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"


def measure_matmul_flops(dtype: torch.dtype, device: torch.device = torch.device("cpu"),
                         budget_s: float = 0.6) -> float:
    """Peak FLOP/s of matmuls in `dtype` on `device`, measured within about budget_s.

    On a CPU: the best rate of one thread (square a @ b and F.linear, which take different
    kernels, 256 to 1024 wide) times the thread count. One thread's short matmuls fit in the
    slices of time a loaded machine gives a process, so the figure does not sink with the
    machine's load as a multi-threaded measurement does (on this project's shared 2-core
    machine one came out 7x low, and the cached figure made every later MFU wrong), and a
    run's threads can only do worse than ideal scaling, so its MFU stays at most 1.
    On a GPU: the best rate growing from 256 to 8192 wide.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return _best_rate(dtype, device, (256, 1024, 4096, 8192), budget_s, torch.cuda.synchronize)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threads * _best_rate(dtype, device, (256, 512, 1024), budget_s, lambda: None)
    finally:
        torch.set_num_threads(threads)


def _best_rate(dtype: torch.dtype, device: torch.device, sizes: tuple[int, ...], budget_s: float,
               sync) -> float:
    """Best FLOP/s over rounds of every size and both kernels until the budget is spent;
    a size whose matmul takes over 50 ms (an emulated dtype) is dropped after its first round."""
    deadline = time.perf_counter() + budget_s
    operands = {}
    best = 0.0
    while sizes:
        for n in sizes:
            if n not in operands:
                operands[n] = (torch.randn(n, n, dtype=dtype, device=device),
                               torch.randn(n, n, dtype=dtype, device=device))
                for op in (torch.mm, F.linear):
                    op(*operands[n])  # warm up: kernel selection, oneDNN primitive creation
                sync()
            slowest = 0.0
            for op in (torch.mm, F.linear):
                start = time.perf_counter()
                op(*operands[n])
                sync()
                seconds = time.perf_counter() - start
                best, slowest = max(best, 2 * n**3 / seconds), max(slowest, seconds)
                if time.perf_counter() > deadline:
                    return best
            if slowest > 0.05:
                sizes = tuple(m for m in sizes if m < n)
                break
    return best


def _machine_key(device: torch.device, dtype: str) -> dict:
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                "dtype": dtype}
    return {"cpu": cpu_model_name(), "isa": torch.backends.cpu.get_cpu_capability(),
            "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": dtype}


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
    unweighted load-balancing loss and router z-loss of the last micro-batch (of all ranks in
    `group` together, as the training loss balances them; the logged loss
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
            if group is not None:  # the last micro-batch on every rank, as aux_loss_sum pools it
                stats, _ = pool_routing(stats, group, loads.new_zeros(()), everything=True)
            figures.update({"moe/aux_loss": load_balancing_loss(stats),
                            "moe/z_loss": router_z_loss(stats)})
    biases = [m.expert_bias for m in layers.values() if m.expert_bias is not None]
    if biases:
        figures.update({"moe/bias_min": torch.stack(biases).min(), "moe/bias_max": torch.stack(biases).max()})
    values = torch.stack([v.float().reshape(()) for v in figures.values()]).tolist()  # the one sync
    record = dict(zip(figures, values))
    record["moe/load_max"] = max(v for k, v in record.items() if k.startswith("moe/load/"))
    return record
