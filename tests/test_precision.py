"""Precision resolution for each kind of hardware (facts injected), the warning, fp8 errors,
and detection on this machine with and without the AVX2 environment."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln.config import PrecisionConfig, load_config
from kiln.errors import KilnError
from kiln.train.precision import (Hardware, autocast, describe_precision, detect_hardware,
                                  grad_scaler, resolve_precision)

REPO = Path(__file__).resolve().parents[1]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def gpu(name, capability, **kw) -> Hardware:
    return Hardware("cuda", name, capability, **kw)


def cpu(flags=(), capability="AVX512", arch="x86_64", isa="", ratio=None) -> Hardware:
    return Hardware("cpu", "test CPU", cpu_arch=arch, cpu_capability=capability,
                    cpu_flags=frozenset(flags), onednn_max_isa=isa, bf16_speed_ratio=ratio)


SAPPHIRE_RAPIDS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
ZEN4 = ("avx2", "avx512f", "avx512_bf16")
ZEN2 = ("avx2", "fma")  # the EPYC: AVX2 only

CASES = [
    # (hardware, auto resolves to, words the reason must contain)
    (gpu("NVIDIA H200", (9, 0)), "bf16", "native bf16"),
    (gpu("NVIDIA A100-SXM4-80GB", (8, 0)), "bf16", "native bf16"),
    (gpu("NVIDIA GeForce RTX 4090", (8, 9)), "bf16", "native bf16"),
    (gpu("Tesla V100-SXM2-16GB", (7, 0)), "fp16", "gradient scaler"),
    (gpu("Tesla T4", (7, 5)), "fp16", "gradient scaler"),
    (gpu("Tesla P40", (6, 1)), "fp32", "no bf16 tensor cores"),
    (gpu("AMD Instinct MI300X", (9, 4), is_rocm=True, rocm_arch="gfx942:sramecc+:xnack-"),
     "bf16", "bf16 matrix cores"),
    (gpu("AMD Instinct MI250X", (9, 0), is_rocm=True, rocm_arch="gfx90a"), "bf16", "matrix"),
    (gpu("AMD Radeon Pro VII", (9, 0), is_rocm=True, rocm_arch="gfx906"), "fp16", "scaler"),
    (cpu(SAPPHIRE_RAPIDS, ratio=4.0), "bf16", "AMX-BF16"),
    (cpu(ZEN4, ratio=1.9), "bf16", "AVX512-BF16"),
    (cpu(ZEN4), "bf16", "AVX512-BF16"),  # not probed: the flags decide
    (cpu(ZEN2, capability="AVX2", ratio=0.01), "fp32", "no native bf16"),
    (cpu(("avx512f", "avx512bw")), "fp32", "no native bf16"),  # AVX-512 without BF16
    # A bf16 CPU under ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2: emulated
    (cpu(SAPPHIRE_RAPIDS, capability="AVX2"), "fp32", "ATEN_CPU_CAPABILITY"),
    (cpu(SAPPHIRE_RAPIDS, isa="AVX2"), "fp32", "ONEDNN_MAX_CPU_ISA"),
    (cpu(SAPPHIRE_RAPIDS, ratio=0.05), "fp32", "measured 20.0x slower"),
    (cpu(("fp", "asimd", "bf16", "sve"), capability="SVE256", arch="aarch64"), "bf16", "Arm BF16"),
    (cpu(("fp", "asimd"), capability="DEFAULT", arch="aarch64"), "fp32", "no native bf16"),
    (Hardware("mps", "mps"), "fp32", "not known"),
]


@pytest.mark.parametrize("hw, expected, words", CASES, ids=lambda c: getattr(c, "device_name", None))
def test_auto_picks_the_native_precision(hw, expected, words):
    p = resolve_precision(PrecisionConfig(), hw)
    assert (p.requested, p.dtype, p.warning) == ("auto", expected, None)
    assert words in p.reason, p.reason
    assert p.needs_grad_scaler == (expected == "fp16")


def test_explicit_bf16_without_native_bf16_runs_and_warns_in_one_paragraph():
    p = resolve_precision(PrecisionConfig(dtype="bf16"), cpu(ZEN2, capability="AVX2", ratio=0.01))
    assert p.dtype == "bf16" and p.compute_dtype == torch.bfloat16
    w = p.warning
    assert "\n" not in w
    for words in ("precision.dtype=bf16", "no native bf16", "100.0x slower than fp32",
                  "precision.dtype: auto", "fp32", "AVX512-BF16 or AMX"):
        assert words in w, w
    # On a V100 the same request warns about the missing tensor cores instead.
    v100 = resolve_precision(PrecisionConfig(dtype="bf16"), gpu("Tesla V100", (7, 0)))
    assert "without tensor cores" in v100.warning and "auto" in v100.warning
    # Where bf16 is native, no warning; fp32 asked for is never second-guessed.
    assert resolve_precision(PrecisionConfig(dtype="bf16"), gpu("NVIDIA H100", (9, 0))).warning is None
    assert resolve_precision(PrecisionConfig(dtype="fp32"), cpu(SAPPHIRE_RAPIDS)).dtype == "fp32"


def test_fp16_gets_a_gradient_scaler_and_bf16_none():
    fp16 = resolve_precision(PrecisionConfig(), gpu("Tesla T4", (7, 5)))
    assert isinstance(grad_scaler(fp16, torch.device("cpu")), torch.amp.GradScaler)
    bf16 = resolve_precision(PrecisionConfig(), gpu("NVIDIA H100", (9, 0)))
    assert grad_scaler(bf16, torch.device("cpu")) is None
    explicit = resolve_precision(PrecisionConfig(dtype="fp16"), cpu(ZEN2, capability="AVX2"))
    assert explicit.needs_grad_scaler and "AVX512-FP16" in explicit.warning


@pytest.mark.parametrize("hw", [gpu("NVIDIA H100 80GB HBM3", (9, 0)), gpu("NVIDIA L40S", (8, 9)),
                                gpu("NVIDIA B200", (10, 0)),
                                gpu("AMD Instinct MI300X", (9, 4), is_rocm=True, rocm_arch="gfx942")])
def test_fp8_on_hardware_with_fp8(hw):
    p = resolve_precision(PrecisionConfig(dtype="fp8"), hw)
    assert (p.dtype, p.compute_dtype, p.matmul_dtype, p.fp8_emulated) == ("fp8", torch.bfloat16, "fp8", False)
    assert "rowwise scaling" in p.reason


@pytest.mark.parametrize("hw, instead", [(gpu("NVIDIA A100-SXM4-80GB", (8, 0)), "bf16"),
                                         (gpu("Tesla T4", (7, 5)), "fp16"),
                                         (cpu(ZEN2, capability="AVX2"), "fp32"),
                                         (cpu(SAPPHIRE_RAPIDS), "bf16")])
def test_fp8_without_fp8_is_a_clear_error_naming_what_to_set(hw, instead):
    with pytest.raises(KilnError) as err:
        resolve_precision(PrecisionConfig(dtype="fp8"), hw)
    message = str(err.value)
    assert "\n" not in message
    for words in ("precision.dtype=fp8", "compute capability 8.9", f"auto (here: {instead})",
                  "precision.fp8_emulate"):
        assert words in message, message
    emulated = resolve_precision(PrecisionConfig(dtype="fp8", fp8_emulate=True), hw)
    assert emulated.fp8_emulated and emulated.matmul_dtype == "bf16"


def test_autocast_and_describe():
    bf16 = resolve_precision(PrecisionConfig(), cpu(ZEN4))
    with autocast(bf16, torch.device("cpu")):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(resolve_precision(PrecisionConfig(), cpu(ZEN2)), torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    hw = cpu(ZEN2, capability="AVX2", isa="AVX2", ratio=0.02)
    record = describe_precision(resolve_precision(PrecisionConfig(dtype="bf16"), hw), hw)
    assert record["requested"] == "bf16" and record["dtype"] == "bf16"
    assert record["onednn_max_isa"] == "AVX2" and record["bf16_speed_vs_fp32"] == 0.02
    assert "warning" in record and json.dumps(record)  # plain data, fit for a config file


def test_shipped_configs_and_default_use_auto():
    assert PrecisionConfig().dtype == "auto"
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert load_config(path).precision.dtype == "auto", path


DETECT = ("import json, torch; from kiln.config import PrecisionConfig; "
          "from kiln.train.precision import detect_hardware, resolve_precision, bf16_support; "
          "hw = detect_hardware(torch.device('cpu')); "
          "print(json.dumps({'native': bf16_support(hw)[0], "
          "'auto': resolve_precision(PrecisionConfig(), hw).dtype, "
          "'capability': hw.cpu_capability, 'isa': hw.onednn_max_isa, "
          "'ratio': hw.bf16_speed_ratio, 'torch_says': torch.cpu._is_avx512_bf16_supported()}))")


def detect_in(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", DETECT], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_avx2_environment_is_detected_as_no_native_bf16():
    # torch.cpu._is_avx512_bf16_supported() reads CPUID and ignores this environment, so the
    # detection must go by the capability string and oneDNN's ISA limit (and the probe).
    facts = detect_in(AVX2_ENV)
    assert (facts["capability"], facts["isa"]) == ("AVX2", "AVX2")
    assert facts["native"] is False and facts["auto"] == "fp32"
    assert facts["ratio"] < 0.5  # bf16 really is emulated there


def test_detection_on_this_machine_agrees_with_its_flags():
    hw = detect_hardware(torch.device("cpu"))
    has_flags = bool({"avx512_bf16", "amx_bf16", "bf16"} & hw.cpu_flags)
    p = resolve_precision(PrecisionConfig(), hw)
    assert p.dtype == ("bf16" if has_flags and hw.bf16_speed_ratio >= 0.5 else "fp32"), p.reason
    # The same facts without a probe resolve the same way, except a probe that vetoes.
    assert resolve_precision(PrecisionConfig(), replace(hw, bf16_speed_ratio=None)).dtype in (p.dtype, "bf16")
