"""The MFU peak: datasheet table, measured and cached CPU peak, override; MFU <= 1 on real runs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.train import metrics
from kiln.train.metrics import cached_measurement, resolve_peak, table_peak_tflops
from kiln.train.trainer import train
from conftest import tiny_job

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200", "fp8", 1978.9),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA H100 NVL", "fp8", 1671),
    ("NVIDIA B200", "bf16", 2250),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ("NVIDIA A10G", "bf16", 140),
    ("NVIDIA A10", "bf16", 125),
    ("NVIDIA L40S", "fp8", 733),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("AMD Instinct MI250X/MI250", "bf16", 191.5),  # one of its two dies
    ("Tesla V100-SXM2-32GB", "fp16", 125),
    ("Tesla V100-SXM2-32GB", "bf16", 15.7),  # no bf16 tensor cores: the CUDA cores' rate
])
def test_known_accelerators_have_dense_datasheet_peaks(name, dtype, tflops):
    assert table_peak_tflops(name, dtype)[1] == tflops


def test_unknown_device_is_not_guessed():
    assert table_peak_tflops("NVIDIA Quadro P620", "bf16") is None


def test_configured_peak_overrides_everything(tmp_path):
    peak = resolve_peak(torch.device("cpu"), "bf16", 12.5, cache_dir=tmp_path)
    assert (peak.flops, peak.source) == (12.5e12, "metrics.peak_tflops")
    assert not (tmp_path / "peak_flops.json").exists()  # nothing measured


def test_cpu_peak_is_measured_quickly_once_then_cached(tmp_path, monkeypatch):
    start = time.perf_counter()
    first = resolve_peak(torch.device("cpu"), "fp32", cache_dir=tmp_path)
    assert time.perf_counter() - start < 3.0  # ~1 s budget, with slack for a loaded machine
    assert first.flops > 1e8 and "measured" in first.source
    cache = json.loads((tmp_path / "peak_flops.json").read_text())
    (key,) = cache
    assert {"cpu", "isa", "threads", "torch", "dtype"} <= set(json.loads(key))

    # A later start measures again; a lower figure (a busy machine) never lowers the peak...
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype, device: first.flops / 10)
    assert resolve_peak(torch.device("cpu"), "fp32", cache_dir=tmp_path).flops == first.flops
    # ... and a higher one (a quiet machine) raises it, for this and later runs.
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype, device: first.flops * 2)
    assert resolve_peak(torch.device("cpu"), "fp32", cache_dir=tmp_path).flops == first.flops * 2
    monkeypatch.undo()
    assert resolve_peak(torch.device("cpu"), "fp32", cache_dir=tmp_path).flops >= first.flops * 2
    # Another thread count is another machine as far as the peak goes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        cached_measurement(torch.device("cpu"), "fp32", tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 2


def test_corrupt_or_unwritable_cache_only_costs_a_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype, device: 7e9)
    (tmp_path / "peak_flops.json").write_text("{not json")
    assert cached_measurement(torch.device("cpu"), "fp32", tmp_path) == 7e9
    assert len(json.loads((tmp_path / "peak_flops.json").read_text())) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be
    assert cached_measurement(torch.device("cpu"), "fp32", blocked / "kiln") == 7e9


def test_cpu_peak_for_bf16_is_never_below_fp32(tmp_path, monkeypatch):
    rates = {torch.float32: 50e9, torch.bfloat16: 1e9}  # bf16 emulated, as on an AVX2 CPU
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype, device: rates[dtype])
    peak = resolve_peak(torch.device("cpu"), "bf16", cache_dir=tmp_path)
    assert peak.flops == 50e9 and "fp32 (faster than bf16 here)" in peak.source


def test_unknown_gpu_is_measured_and_its_fp8_is_twice_bf16(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Mystery GPU")
    measured = []

    def measure(dtype, device):
        measured.append((dtype, device.type))
        return 100e12

    monkeypatch.setattr(metrics, "measure_matmul_flops", measure)
    cuda = torch.device("cuda")
    assert resolve_peak(cuda, "bf16", cache_dir=tmp_path).flops == 100e12
    fp8 = resolve_peak(cuda, "fp8", cache_dir=tmp_path)  # from the cached bf16 figure
    assert fp8.flops == 200e12 and "2x its measured bf16" in fp8.source
    assert measured == [(torch.bfloat16, "cuda")]
    assert resolve_peak(cuda, "bf16", 50.0, cache_dir=tmp_path).flops == 50e12


def mfus(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["mfu"] for x in lines if "mfu" in x]


def test_mfu_of_a_real_run_is_at_most_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = tiny_job(tmp_path, metrics={"peak_tflops": None},
                   train={"max_steps": 20, "log_interval": 5, "sample_tokens": 0})
    train(cfg)
    values = mfus(cfg.run_dir)
    assert len(values) == 4 and all(0 < v <= 1 for v in values), values
    assert (tmp_path / "cache/kiln/peak_flops.json").exists()


def test_mfu_is_at_most_one_with_bf16_on_a_cpu_without_it(tmp_path):
    """The issue's case: bf16 asked for where it is emulated (the AVX2 environment)."""
    cfg = tiny_job(tmp_path, metrics={"peak_tflops": None}, precision={"dtype": "bf16"},
                   train={"max_steps": 10, "log_interval": 5, "sample_tokens": 0})
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-m", "kiln", "train", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    values = mfus(cfg.run_dir)
    assert len(values) == 2 and all(0 < v <= 1 for v in values), values
