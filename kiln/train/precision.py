"""Mixed precision chosen from the hardware: which compute dtype, why, and the autocast and
gradient scaler that go with it. Parameters and optimizer state always stay fp32.

`detect_hardware` gathers the facts (the only part that looks at the machine);
`resolve_precision` is a pure function of the config and those facts, so every hardware case
is testable anywhere.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.config import PrecisionConfig
from kiln.errors import KilnError

# oneDNN (which runs PyTorch's CPU matmuls) limited to one of these ISAs has no bf16 or fp16
# instructions and emulates them; ONEDNN_MAX_CPU_ISA=AVX2 is how one makes such a CPU.
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ONEDNN_WITHOUT_FP16 = _ONEDNN_WITHOUT_BF16 | {"AVX2_VNNI_2", "AVX512_CORE_BF16"}
# A probe below this bf16/fp32 speed ratio means bf16 is emulated whatever the flags say
# (native AVX512-BF16 runs bf16 about 2x fp32, AMX far more; emulation 0.02-0.4x).
_NATIVE_MIN_RATIO = 0.5
# ROCm architectures with bf16 matrix cores: MI100 (gfx908), MI200 (gfx90a), MI300 (gfx94x),
# MI350 (gfx95x), RDNA3/4 (gfx11, gfx12); FP8: MI300 (gfx942), MI350 (gfx950), RDNA4 (gfx12).
_ROCM_BF16 = ("gfx908", "gfx90a", "gfx94", "gfx95", "gfx11", "gfx12")
_ROCM_FP8 = ("gfx942", "gfx950", "gfx12")
_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                 "fp8": torch.bfloat16}  # fp8: converted linears; everything else bf16 autocast


@dataclass(frozen=True)
class Hardware:
    """The facts about the device that decide the precision (injected in tests)."""

    device_type: str
    """torch device type: cuda (also ROCm), cpu, mps, ..."""
    device_name: str = ""
    """GPU name (torch.cuda.get_device_name) or CPU model name."""
    cuda_capability: tuple[int, int] | None = None
    is_rocm: bool = False
    rocm_arch: str = ""
    """gcnArchName, e.g. gfx942:sramecc+:xnack-"""
    cpu_arch: str = ""
    """platform.machine(): x86_64, aarch64, arm64, ..."""
    cpu_capability: str = ""
    """torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT, SVE256, ... (follows
    ATEN_CPU_CAPABILITY)."""
    cpu_flags: frozenset[str] = field(default_factory=frozenset)
    """CPU feature flags: /proc/cpuinfo flags (x86) or Features (Arm), lower case."""
    onednn_max_isa: str = ""
    """ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) from the environment, upper case; '' if unset."""
    bf16_speed_ratio: float | None = None
    """CPU only: measured bf16 / fp32 speed of a small linear layer; None if not measured."""

    @property
    def is_gpu(self) -> bool:
        return self.device_type == "cuda"

    def describe(self) -> str:
        if self.is_gpu and self.is_rocm:
            return f"{self.device_name} ({self.rocm_arch.split(':')[0]})"
        if self.is_gpu and self.cuda_capability:
            return f"{self.device_name} (compute capability {'.'.join(map(str, self.cuda_capability))})"
        return self.device_name or self.device_type


@dataclass(frozen=True)
class Precision:
    """The resolved choice: what runs, why, and what to warn about."""

    requested: str
    dtype: str
    """fp32, bf16, fp16 or fp8."""
    reason: str
    warning: str | None = None
    fp8_emulated: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        """The autocast dtype (fp8 runs its converted linears in fp8, the rest in bf16)."""
        return _TORCH_DTYPES[self.dtype]

    @property
    def needs_grad_scaler(self) -> bool:
        return self.dtype == "fp16"

    @property
    def matmul_dtype(self) -> str:
        """The dtype the big matmuls really run in, for the MFU peak."""
        return "bf16" if self.fp8_emulated else self.dtype

    @property
    def summary(self) -> str:
        return f"precision {self.dtype} ({self.reason})"


def detect_hardware(device: torch.device, probe: bool = True) -> Hardware:
    """The facts about `device` and this process's environment; probe: time bf16 on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Hardware("cuda", props.name, (props.major, props.minor),
                        is_rocm=torch.version.hip is not None,
                        rocm_arch=getattr(props, "gcnArchName", "") or "")
    if device.type != "cpu":
        return Hardware(device.type, device.type)
    model, flags = _cpu_model_and_flags()
    # torch's own checks read CPUID; they ignore ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA,
    # which is why those are facts of their own below.
    if _torch_check("_is_avx512_bf16_supported"):
        flags.add("avx512_bf16")
    if _torch_check("_is_amx_fp16_supported"):
        flags.add("amx_fp16")
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return Hardware("cpu", model, cpu_arch=platform.machine().lower(),
                    cpu_capability=torch.backends.cpu.get_cpu_capability(),
                    cpu_flags=frozenset(flags), onednn_max_isa=isa.strip().upper(),
                    bf16_speed_ratio=measure_bf16_speed_ratio() if probe else None)


def resolve_precision(cfg: PrecisionConfig, hw: Hardware) -> Precision:
    """The dtype to train in and why; KilnError for fp8 on hardware without it."""
    asked = cfg.dtype
    native_bf16, why_bf16 = bf16_support(hw)
    native_fp16, why_fp16 = fp16_support(hw)
    where = hw.describe()
    if asked == "auto":
        if native_bf16:
            return Precision(asked, "bf16", f"auto: {why_bf16}")
        if hw.is_gpu and native_fp16:
            return Precision(asked, "fp16", f"auto: {where} has fp16 tensor cores but no bf16: "
                                            f"fp16 autocast with a gradient scaler")
        return Precision(asked, "fp32", f"auto: {why_bf16}, so fp32 is the fast path")
    if asked == "fp32":
        return Precision(asked, "fp32", "set in the config")
    if asked == "bf16":
        warning = None if native_bf16 else _slow_warning("bf16", why_bf16, hw)
        return Precision(asked, "bf16", f"set in the config; {why_bf16}", warning)
    if asked == "fp16":
        warning = None if native_fp16 else _slow_warning("fp16", why_fp16, hw)
        return Precision(asked, "fp16", f"set in the config, with a gradient scaler; {why_fp16}",
                         warning)
    has_fp8, why_fp8 = fp8_support(hw)
    if cfg.fp8_emulate:
        return Precision(asked, "fp8", f"set in the config, emulated (precision.fp8_emulate); "
                                       f"{why_fp8}", fp8_emulated=True)
    if has_fp8:
        return Precision(asked, "fp8", f"set in the config; {why_fp8}; {cfg.fp8_recipe} scaling")
    instead = "bf16" if native_bf16 else ("fp16" if native_fp16 else "fp32")
    raise KilnError(
        f"precision.dtype=fp8 needs a GPU with FP8 tensor cores (NVIDIA compute capability 8.9 "
        f"or newer: L40S, RTX 4090, H100, H200, B200; AMD MI300X), but {why_fp8}. Set "
        f"precision.dtype to auto (here: {instead}) or {instead}; precision.fp8_emulate: true "
        f"runs float8 in emulation, for testing numerics only.")


def bf16_support(hw: Hardware) -> tuple[bool, str]:
    """Whether bf16 matmuls run natively on `hw`, and a phrase saying why (not)."""
    where = hw.describe()
    if hw.is_gpu and hw.is_rocm:
        ok = hw.rocm_arch.startswith(_ROCM_BF16)
        return ok, f"{where} {'has' if ok else 'has no'} bf16 matrix cores"
    if hw.is_gpu:
        ok = hw.cuda_capability is not None and hw.cuda_capability >= (8, 0)
        return ok, (f"{where} has native bf16" if ok else
                    f"{where} has no bf16 tensor cores (compute capability 8.0+ has)")
    if hw.device_type != "cpu":
        return False, f"bf16 support on {hw.device_type} is not known to kiln"
    return _cpu_support(hw, "bf16", {"avx512_bf16", "amx_bf16"}, {"bf16"}, _ONEDNN_WITHOUT_BF16)


def fp16_support(hw: Hardware) -> tuple[bool, str]:
    """Whether fp16 matmuls run natively on `hw` (tensor cores, AVX512-FP16/AMX-FP16)."""
    where = hw.describe()
    if hw.is_gpu and hw.is_rocm:
        return True, f"{where} has fp16 matrix cores"
    if hw.is_gpu:
        ok = hw.cuda_capability is not None and hw.cuda_capability >= (7, 0)
        return ok, (f"{where} has fp16 tensor cores" if ok else f"{where} has no tensor cores")
    if hw.device_type != "cpu":
        return False, f"fp16 support on {hw.device_type} is not known to kiln"
    # The bf16 probe says nothing about fp16, so fp16 goes by the flags alone.
    return _cpu_support(replace(hw, bf16_speed_ratio=None), "fp16",
                        {"avx512_fp16", "amx_fp16"}, {"fphp", "asimdhp"}, _ONEDNN_WITHOUT_FP16)


def fp8_support(hw: Hardware) -> tuple[bool, str]:
    where = hw.describe()
    if hw.is_gpu and hw.is_rocm:
        ok = hw.rocm_arch.startswith(_ROCM_FP8)
        return ok, f"{where} {'has' if ok else 'has no'} FP8 matrix cores"
    if hw.is_gpu:
        ok = hw.cuda_capability is not None and hw.cuda_capability >= (8, 9)
        return ok, f"{where} {'has' if ok else 'has no'} FP8 tensor cores"
    return False, f"this device is a {hw.device_type.upper()} ({where})"


def autocast(precision: Precision | PrecisionConfig, device: torch.device):
    """The autocast context for the step (a no-op for fp32).

    Given the config section instead of a resolved Precision, it resolves it first (without
    printing anything): a convenience for benchmarks and tests.
    """
    if isinstance(precision, PrecisionConfig):
        precision = resolve_precision(precision, detect_hardware(device, probe=False))
    if precision.dtype == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=precision.compute_dtype)


def grad_scaler(precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 (its 5 exponent bits underflow small gradients), else None."""
    if not precision.needs_grad_scaler:
        return None
    return torch.amp.GradScaler(torch.device(device).type)


def describe_precision(precision: Precision, hw: Hardware) -> dict:
    """The record of the choice, for the run's resolved config and metrics log."""
    record = {"requested": precision.requested, "dtype": precision.dtype,
              "reason": precision.reason, "grad_scaler": precision.needs_grad_scaler,
              "device": hw.describe()}
    if hw.device_type == "cpu":
        record["cpu_capability"] = hw.cpu_capability
        if hw.onednn_max_isa:
            record["onednn_max_isa"] = hw.onednn_max_isa
        if hw.bf16_speed_ratio is not None:
            record["bf16_speed_vs_fp32"] = round(hw.bf16_speed_ratio, 3)
    if precision.fp8_emulated:
        record["fp8_emulated"] = True
    if precision.warning:
        record["warning"] = precision.warning
    return record


def measure_bf16_speed_ratio(n: int = 256, repeats: int = 5) -> float:
    """bf16 / fp32 speed of an n x n linear layer on one CPU thread, best of `repeats`.

    One thread: it measures the instructions, not how the machine's other load happens to
    fall on a multi-threaded kernel (with 2 threads on a shared machine the ratio wandered
    from 0.3 to 1.6 where one thread gave 0.11-0.13 every time). 10-40 ms.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = {}
        tensors = {dt: (torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt))
                   for dt in (torch.float32, torch.bfloat16)}
        for x, w in tensors.values():
            F.linear(x, w)  # the first call builds oneDNN's kernel
        for _ in range(repeats):
            for dt, (x, w) in tensors.items():  # interleaved, so load on the machine hits both
                start = time.perf_counter()
                F.linear(x, w)
                best[dt] = min(best.get(dt, float("inf")), time.perf_counter() - start)
        return best[torch.float32] / best[torch.bfloat16]
    finally:
        torch.set_num_threads(threads)


def _cpu_support(hw: Hardware, name: str, x86_flags: set[str], arm_flags: set[str],
                 onednn_without: set[str]) -> tuple[bool, str]:
    arm = hw.cpu_arch in ("aarch64", "arm64")
    wanted = arm_flags if arm else x86_flags
    if not wanted & hw.cpu_flags:
        kinds = " or ".join(sorted(_flag_name(f) for f in wanted))
        return False, f"this CPU has no native {name} ({kinds})"
    if not arm and not hw.cpu_capability.upper().startswith("AVX512"):
        return False, (f"PyTorch's CPU kernels are limited to {hw.cpu_capability or 'DEFAULT'} "
                       f"(ATEN_CPU_CAPABILITY), which has no {name}")
    if hw.onednn_max_isa in onednn_without:
        return False, (f"oneDNN is limited to {hw.onednn_max_isa} (ONEDNN_MAX_CPU_ISA), "
                       f"which has no {name}")
    ratio = hw.bf16_speed_ratio
    if ratio is not None and ratio < _NATIVE_MIN_RATIO:
        return False, f"a {name} matmul measured {1 / ratio:.1f}x slower than fp32 on this CPU"
    have = " and ".join(sorted(_flag_name(f) for f in wanted & hw.cpu_flags))
    return True, f"this CPU has native {name} ({have})"


def _flag_name(flag: str) -> str:
    return {"bf16": "Arm BF16", "fphp": "Arm FP16", "asimdhp": "Arm FP16 SIMD"}.get(
        flag, flag.upper().replace("_", "-"))


def _slow_warning(dtype: str, why: str, hw: Hardware) -> str:
    if hw.is_gpu:
        slower = (f"{dtype} matmuls run without tensor cores, several times slower than "
                  f"{'fp16' if dtype == 'bf16' else 'fp32'}")
    elif hw.bf16_speed_ratio is not None and dtype == "bf16":
        slower = f"a bf16 matmul measured {1 / hw.bf16_speed_ratio:.1f}x slower than fp32 here"
    else:
        slower = f"PyTorch emulates {dtype} matmuls, typically 3-100x slower than fp32"
    where = ("GPUs of compute capability 8.0+ and on CPUs with AVX512-BF16 or AMX (Intel "
             "Cooper Lake, Sapphire Rapids and newer; AMD Zen 4 and newer) or Arm bf16"
             if dtype == "bf16" else
             "GPUs of compute capability 7.0+ and on CPUs with AVX512-FP16 (Intel Sapphire "
             "Rapids and newer)")
    return (f"precision.dtype={dtype} was asked for, but {why}: {slower}. Training runs, "
            f"only slower. Set precision.dtype: auto (it picks the fastest native precision "
            f"here) or fp32; {dtype} pays off on {where}.")


def cpu_model_name() -> str:
    return _cpu_model_and_flags()[0]


def _cpu_model_and_flags() -> tuple[str, set[str]]:
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return _darwin_cpu()
    info: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():  # the first processor's entry is enough
        key, _, value = line.partition(":")
        info.setdefault(key.strip().lower(), value.strip())
    arm_part = " ".join(info[k] for k in ("cpu implementer", "cpu part") if k in info)
    model = info.get("model name") or (f"Arm CPU {arm_part}" if arm_part else
                                       platform.processor() or platform.machine())
    flags = set((info.get("flags") or info.get("features") or "").lower().split())
    return model, flags


def _darwin_cpu() -> tuple[str, set[str]]:
    def sysctl(name: str) -> str:
        try:
            return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    flags = {"bf16"} if sysctl("hw.optional.arm.FEAT_BF16") == "1" else set()
    if sysctl("hw.optional.arm.FEAT_FP16") == "1":
        flags.add("fphp")
    return sysctl("machdep.cpu.brand_string") or "Apple CPU", flags


def _torch_check(name: str) -> bool:
    # Private torch.cpu helpers: present in 2.11-2.13, guarded in case they move.
    check = getattr(torch.cpu, name, None)
    try:
        return bool(check()) if check else False
    except Exception:  # noqa: BLE001 - a failed feature check means "not known to be there"
        return False
