"""Training throughput and peak memory of a small mixture of experts against the dense model
with the same active parameters, on the CPU.

    .venv/bin/python bench/moe.py                         # 3 rounds, fp32
    .venv/bin/python bench/moe.py --precision bf16 --rounds 1 --steps 8

Dense: the `bench-7m` preset (hidden 256, 4 layers, SwiGLU 704, vocab 8192). MoE: the same with
8 experts of 352 per layer, 2 per token (the same active weights per token; 3.6x the MLP
weights in all), aux loss and z-loss on. The MoE runs twice: its experts through
torch._grouped_mm (one kernel per matrix) and through a loop over experts. Sequence 256,
micro-batch 8, AdamW, the same random tokens, each run its own subprocess (peak RSS its own),
the row order alternating between rounds. Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kiln from this checkout
from throughput import BATCH, SEED, SEQ_LEN, THREADS, rss_mb, run_worker  # noqa: E402  (bench/ is on the path)

ROWS = [("dense", None), ("moe grouped", "grouped"), ("moe loop", "loop")]
MOE = dict(n_experts=8, top_k=2, intermediate_size=352, aux_loss_coef=0.01, router_z_loss_coef=1e-3)


def model_config(moe: bool):
    from kiln.config import ModelConfig
    return ModelConfig(preset="bench-7m", moe=MOE if moe else None)


def run(compute: str | None, precision: str, warmup: int, steps: int) -> dict:
    from kiln.config import OptimConfig, PrecisionConfig
    from kiln.data.batch import Batch
    from kiln.models.moe import moe_layers
    from kiln.models.transformer import Transformer
    from kiln.tasks.pretrain import Pretrain
    from kiln.train.optim import build_optimizer
    from kiln.train.precision import autocast
    from kiln.train.trainer import train_step

    cfg = model_config(compute is not None)
    data = torch.randint(0, cfg.vocab_size, ((warmup + steps) * BATCH, SEQ_LEN + 1),
                         generator=torch.Generator().manual_seed(SEED))
    model = Transformer(cfg)
    model.init_weights(SEED)
    for layer in moe_layers(model).values():
        layer.experts.compute = compute
    ocfg = OptimConfig()
    optimizer = build_optimizer(model, ocfg)
    amp = autocast(PrecisionConfig(dtype=precision), torch.device("cpu"))
    ends, losses = [], []
    for i in range(warmup + steps):
        rows = data[i * BATCH:(i + 1) * BATCH]
        loss, _ = train_step(model, optimizer, Pretrain().loss_sum,
                             [Batch(rows[:, :-1], rows[:, 1:])], amp, ocfg.grad_clip)
        losses.append(float(loss))
        ends.append(time.perf_counter())
    wall = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]
    return {"tokens_per_s": BATCH * SEQ_LEN / statistics.median(wall),
            "peak_rss_mb": rss_mb("VmHWM"), "mean_loss": statistics.mean(losses)}


def spawn(name: str, precision: str, warmup: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, "--precision", precision,
           "--warmup", str(warmup), "--steps", str(steps)]
    return run_worker(cmd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per run")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--worker", choices=[name for name, _ in ROWS], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(THREADS)
        result = run(dict(ROWS)[args.worker], args.precision, args.warmup, args.steps)
        print("RESULT " + json.dumps(result), flush=True)
        return

    from kiln.models.moe import grouped_mm_works
    from kiln.models.transformer import count_parameters, flops_per_token

    dense, moe = model_config(False), model_config(True)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, {THREADS} threads, "
          f"{args.precision}, grouped_mm on this CPU: {grouped_mm_works('cpu', dtype)}")
    for name, cfg in (("dense", dense), ("moe", moe)):
        print(f"{name}: {count_parameters(cfg) / 1e6:.2f}M parameters, "
              f"{count_parameters(cfg, active=True) / 1e6:.2f}M active, "
              f"{flops_per_token(cfg, SEQ_LEN) / 1e6:.2f} MFLOP/token")
    results: dict[str, list[dict]] = {name: [] for name, _ in ROWS}
    for round_ in range(args.rounds):
        for name, _ in ROWS if round_ % 2 == 0 else ROWS[::-1]:
            r = spawn(name, args.precision, args.warmup, args.steps)
            results[name].append(r)
            print(f"  round {round_ + 1}  {name:<12} {r['tokens_per_s']:8,.0f} tokens/s  peak RSS "
                  f"{r['peak_rss_mb']:6,.0f} MB  mean loss {r['mean_loss']:.3f}", flush=True)
    print(f"\n{'run':<12} {'tokens/s':>9} {'vs dense':>9} {'peak RSS MB':>12}")
    for name, _ in ROWS:
        tps = statistics.median(r["tokens_per_s"] for r in results[name])
        ratio = statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                  for a, b in zip(results[name], results["dense"]))
        rss = statistics.median(r["peak_rss_mb"] for r in results[name])
        print(f"{name:<12} {tps:9,.0f} {ratio:8.2f}x {rss:12,.0f}")
    print("(medians over rounds of each run's median step; vs dense: per round, then the median)")


if __name__ == "__main__":
    main()
