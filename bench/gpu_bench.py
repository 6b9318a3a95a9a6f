"""GPU training throughput: tokens/s, MFU and peak memory of kiln's step on Llama shapes.

    python bench/gpu_bench.py                 # the table, on CUDA (bench/gpu.sh runs it)
    python bench/gpu_bench.py --cases 1b-bf16 # some rows only
    python bench/gpu_bench.py --cpu-smoke     # the same code on tiny shapes, on the CPU

Rows: Llama-3.2-1B (sequence 2048) in bf16 with compile and activation checkpointing; then a
Llama-3.2-3B shape in bf16 and in fp8 (torchao float8, rowwise), same settings; then a
Qwen3-MoE shape (Qwen3-30B-A3B's layers, 6 of them) in bf16, MFU over its active parameters. The model,
optimizer, precision, fp8 conversion, compile and checkpointing are kiln's own; the tokens are
random (throughput does not depend on them). Each row runs in its own subprocess (its own
peak memory, its own compile caches, and an out-of-memory row does not stop the others).
Tokens/s counts only the steps after warm-up, where compile happens. Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kiln from this checkout

# Llama-3.2-3B's shape (its config.json), on top of the 1B preset's vocabulary and RoPE.
LLAMA_3B = dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192)
QWEN3_MOE = dict(preset="qwen3-30b-a3b", n_layers=6)


@dataclass
class Case:
    shape: dict
    precision: str
    batch: int
    seq: int
    smoke_shape: dict = field(default_factory=dict)


CASES = {
    "1b-bf16": Case({}, "bf16", batch=8, seq=2048),
    "3b-bf16": Case(LLAMA_3B, "bf16", batch=8, seq=2048),
    "3b-fp8": Case(LLAMA_3B, "fp8", batch=8, seq=2048),
    # Qwen3-30B-A3B's layers (128 experts, 8 per token, grouped GEMMs), 6 of its 48: ~4B
    # parameters, 0.6B active; weights, gradients and AdamW state fit one H200.
    "moe-bf16": Case(QWEN3_MOE, "bf16", batch=4, seq=2048,
                     smoke_shape=dict(moe=dict(n_experts=8, top_k=2, intermediate_size=32))),
}
SMOKE = dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128)


def run_case(name: str, smoke: bool, warmup: int, steps: int) -> dict:
    from torch import nn

    from kiln.config import JobConfig, PrecisionConfig
    from kiln.data.batch import Batch
    from kiln.models.transformer import Transformer, count_parameters, flops_per_token
    from kiln.parallel import parallelize
    from kiln.parallel.float8 import convert_to_float8
    from kiln.tasks import build_task
    from kiln.train.metrics import resolve_peak
    from kiln.train.optim import build_optimizer
    from kiln.train.precision import autocast, detect_hardware, resolve_precision

    case = CASES[name]
    device = torch.device("cpu" if smoke else "cuda")
    batch, seq = (2, 64) if smoke else (case.batch, case.seq)
    # fp8 emulated on the CPU, with the smoke shape's small layers converted anyway.
    precision_cfg = dict(dtype=case.precision, fp8_emulate=smoke,
                         fp8_min_dim=32 if smoke else PrecisionConfig().fp8_min_dim)
    cfg = JobConfig.model_validate({
        "model": {"preset": "llama-3.2-1b", "max_seq_len": seq,
                  **({**SMOKE, **case.smoke_shape} if smoke else case.shape)},
        "data": {"seq_len": seq}, "precision": precision_cfg,
        "train": {"compile": not smoke, "activation_checkpointing": True}})
    hw = detect_hardware(device, probe=False)
    precision = resolve_precision(cfg.precision, hw)
    # As kiln.train.build builds a run: on the meta device, fp8 conversion before parallelize
    # (compile, checkpointing), then materialised on the device.
    with torch.device("meta"):
        model = Transformer(cfg.model)
    converted = convert_to_float8(model, cfg.precision, hw) if precision.dtype == "fp8" else []
    parallelize(model, None, cfg)
    model.to_empty(device=device)
    model.tie_weights()
    init_on_device(model, cfg.model.init_std)
    optimizer = build_optimizer(model, cfg.optim)
    loss_sum = build_task("pretrain").loss_sum
    amp = autocast(precision, device)
    data = torch.randint(0, cfg.model.vocab_size, (warmup + steps, batch, seq + 1),
                         generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(i: int) -> torch.Tensor:
        b = Batch(tokens=data[i, :, :-1], labels=data[i, :, 1:])
        with amp:
            loss = loss_sum(model, b) / b.labels.numel()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    start = time.perf_counter()
    first = [step(i) for i in range(warmup)][0]
    sync()
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        last = step(i)
    sync()
    seconds = time.perf_counter() - start
    tokens_per_s = steps * batch * seq / seconds
    peak = resolve_peak(device, precision.matmul_dtype)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    mfu = tokens_per_s * flops_per_token(cfg.model, seq) / peak.flops
    return {"case": name, "params_b": count_parameters(cfg.model) / 1e9,
            "precision": precision.summary, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "peak": peak.source, "peak_mem_gib": peak_mem, "warmup_s": warmup_s,
            "loss_first": first.item(), "loss_last": last.item(), "fp8_layers": len(converted),
            "batch": batch, "seq": seq, "steps": steps}


@torch.no_grad()
def init_on_device(model: torch.nn.Module, std: float) -> None:
    """Random weights drawn on the device: Transformer.init_weights draws each tensor on the
    CPU (the same weights for any sharding), which for 3B parameters costs most of a minute;
    throughput does not depend on the values."""
    model.inv_freq = model._inv_freq().to(model.inv_freq.device)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            p.fill_(1.0 if "norm" in name else 0.0)
        else:
            p.normal_(0.0, std)


def spawn(name: str, args, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--warmup", str(args.warmup),
           "--steps", str(args.steps)] + (["--cpu-smoke"] if args.cpu_smoke else [])
    if timeout < 10:
        return {"case": name, "error": "skipped: the --budget was spent"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": name, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"case": name, "error": f"exit {proc.returncode}: {tail[:200]}"}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':<9} {'params':>7} {'batch x seq':>12} {'tokens/s':>10} {'MFU':>6} "
          f"{'peak mem':>9} {'warm-up':>8} {'loss':>14}  precision / peak")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<9} {'-':>7} {'-':>12} {'-':>10} {'-':>6} {'-':>9} {'-':>8} "
                  f"{'-':>14}  {r['error']}")
            continue
        print(f"{r['case']:<9} {r['params_b']:6.2f}B {r['batch']:>5} x {r['seq']:<5} "
              f"{r['tokens_per_s']:10,.0f} {r['mfu']:6.1%} {r['peak_mem_gib']:7.1f}Gi "
              f"{r['warmup_s']:7.0f}s {r['loss_first']:6.3f}->{r['loss_last']:6.3f}  "
              f"{r['precision']}; peak {r['peak']}"
              + (f"; {r['fp8_layers']} fp8 layers" if r["fp8_layers"] else ""))
    by = {r["case"]: r for r in rows if "error" not in r}
    if "3b-bf16" in by and "3b-fp8" in by:
        ratio = by["3b-fp8"]["tokens_per_s"] / by["3b-bf16"]["tokens_per_s"]
        print(f"\nfp8 / bf16 tokens/s on the 3B shape: {ratio:.2f}x (target >= 1.25x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (compile happens here)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per case at most")
    parser.add_argument("--budget", type=int, default=600,
                        help="seconds for all cases: the table is printed within it")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_case(args.worker, args.cpu_smoke, args.warmup, args.steps)), flush=True)
        return
    if not args.cpu_smoke and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device (use --cpu-smoke to check the script on a CPU)")
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        sys.exit(f"gpu_bench: unknown case(s) {unknown}; known: {', '.join(CASES)}")
    rows, deadline = [], time.monotonic() + args.budget
    for name in names:
        rows.append(spawn(name, args, min(args.timeout, deadline - time.monotonic())))
        print(json.dumps(rows[-1]), flush=True)
    device = "CPU (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
    print(f"\n{device}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{time.strftime('%Y-%m-%d')}; compile + activation checkpointing, AdamW, random tokens")
    print_table(rows)


if __name__ == "__main__":
    main()
