"""Training throughput and peak memory: kiln against Hugging Face `transformers.Trainer`.

    .venv/bin/python bench/throughput.py                          # the full run: 3 rounds, ~30 min
    .venv/bin/python bench/throughput.py --rounds 1 --steps 8     # a quick look
    .venv/bin/python bench/throughput.py --rows "kiln bf16,HF bf16"  # some rows only
    .venv/bin/python bench/throughput.py --before ../kiln-old --rows "kiln fp32,before fp32"
                                         # this checkout against another one (e.g. a worktree
                                         # of an earlier commit), alternating, same workload

The workload is the `bench-7m` preset (Llama shape, vocab 8192, hidden 256, 4 layers, 8 heads,
4 KV heads, SwiGLU 704, untied), sequence 256, micro-batch 8, AdamW, 2 threads, on the same
random tokens for both. Every run is its own subprocess, so its peak RSS is its own; runs
alternate kiln and HF within each round so that noise on a shared machine falls on both, and
ratios are taken between the runs of one round. Tokens/s counts only the steps after warm-up
(which is also where torch.compile compiles). Writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kiln from this checkout

SEQ_LEN, BATCH, THREADS, SEED = 256, 8, 2, 0

# (name, framework, precision, compile); each round runs them in this order, or reversed.
ROWS = [
    ("kiln fp32", "kiln", "fp32", False),
    ("HF fp32", "hf", "fp32", False),
    ("kiln bf16", "kiln", "bf16", False),
    ("HF bf16", "hf", "bf16", False),
    ("kiln bf16 compile", "kiln", "bf16", True),
    ("kiln fp32 compile", "kiln", "fp32", True),
    # With --before DIR: kiln as that other checkout has it.
    ("before fp32", "before", "fp32", False),
    ("before bf16", "before", "bf16", False),
]
# (numerator, denominator, target): the targets on tokens/s; memory must not exceed HF's.
RATIOS = [
    ("kiln fp32", "HF fp32", 1.25),
    ("kiln bf16", "HF fp32", 2.0),
    ("kiln bf16", "HF bf16", 1.3),
    ("kiln bf16 compile", "HF fp32", 2.0),
    ("kiln bf16 compile", "HF bf16", 1.3),
    ("kiln fp32 compile", "HF fp32", 1.25),
    ("kiln fp32", "before fp32", 1.0),
    ("kiln bf16", "before bf16", 1.0),
]


def model_config():
    from kiln.config import ModelConfig
    return ModelConfig(preset="bench-7m")


def tokens(steps: int) -> torch.Tensor:
    """(steps * batch, seq + 1) random token rows: the same for kiln and HF."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, model_config().vocab_size, (steps * BATCH, SEQ_LEN + 1), generator=g)


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MB.

    Not getrusage's ru_maxrss: a child started by fork and exec inherits its parent's peak there.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def run_kiln(precision: str, compile: bool, warmup: int, steps: int) -> tuple[list, float]:
    """kiln's own step: Transformer, parallelize (compile per block), fused AdamW, autocast."""
    from kiln.config import JobConfig, OptimConfig, PrecisionConfig, ScheduleConfig, TrainConfig
    from kiln.models.transformer import Transformer
    from kiln.parallel import parallelize
    from kiln.train.optim import build_optimizer
    from kiln.train.precision import autocast
    from kiln.train.schedule import lr_multiplier
    from kiln.data.batch import Batch
    from kiln.tasks.pretrain import Pretrain
    from kiln.train.trainer import train_step

    data = tokens(warmup + steps)
    torch.manual_seed(SEED)
    model = Transformer(model_config())
    model.init_weights(SEED)
    model = parallelize(model, None, JobConfig(train=TrainConfig(compile=compile, num_threads=THREADS)))
    ocfg = OptimConfig()
    optimizer = build_optimizer(model, ocfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(ScheduleConfig(), warmup + steps))
    amp = autocast(PrecisionConfig(dtype=precision), torch.device("cpu"))
    step_ends, losses = [], []
    for i in range(warmup + steps):
        rows = data[i * BATCH:(i + 1) * BATCH]
        loss, _ = train_step(model, optimizer, Pretrain().loss_sum, [Batch(rows[:, :-1], rows[:, 1:])], amp, ocfg.grad_clip)
        scheduler.step()
        step_ends.append((time.perf_counter(), time.process_time()))
        losses.append(float(loss))
    return step_ends, statistics.mean(losses)


def run_hf(precision: str, warmup: int, steps: int) -> tuple[list, float]:
    """transformers.Trainer on LlamaForCausalLM (SDPA attention), its own bf16 switch."""
    import transformers
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)
    transformers.logging.set_verbosity_error()

    cfg = model_config()
    data = tokens(warmup + steps)[:, :SEQ_LEN]  # HF shifts the labels itself

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False, attn_implementation="sdpa"))
    times = StepTimes()
    with tempfile.TemporaryDirectory() as out_dir:  # save_strategy="no": nothing is written
        args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=BATCH, max_steps=warmup + steps,
            use_cpu=True, bf16=precision == "bf16", report_to=[], save_strategy="no",
            logging_strategy="no", eval_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, seed=SEED)
        out = Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[times]).train()
    return times.ends, out.training_loss


def worker(args) -> None:
    torch.set_num_threads(THREADS)
    before = rss_mb("VmRSS")
    if args.framework == "kiln":
        ends, mean_loss = run_kiln(args.precision, args.compile, args.warmup, args.steps)
    else:
        ends, mean_loss = run_hf(args.precision, args.warmup, args.steps)
    # Each step's time is from the end of the one before: data, forward, backward, optimizer.
    timed = ends[args.warmup - 1:]
    wall = [b[0] - a[0] for a, b in zip(timed, timed[1:])]
    cpu = [b[1] - a[1] for a, b in zip(timed, timed[1:])]
    step_tokens = BATCH * SEQ_LEN
    print("RESULT " + json.dumps({
        "tokens_per_s": step_tokens / statistics.median(wall),
        "cpu_tokens_per_s": step_tokens * THREADS / statistics.median(cpu),
        "peak_rss_mb": rss_mb("VmHWM"), "rss_before_mb": before, "mean_loss": mean_loss}), flush=True)


def spawn(framework: str, precision: str, compile: bool, warmup: int, steps: int,
          before: str | None = None) -> dict:
    script = __file__
    if framework == "before":  # the other checkout's own worker runs its own kiln
        script, framework = str(Path(before) / "bench" / "throughput.py"), "kiln"
    cmd = [sys.executable, script, "--worker", framework, "--precision", precision,
           "--warmup", str(warmup), "--steps", str(steps)] + (["--compile"] if compile else [])
    return run_worker(cmd)


def run_worker(cmd: list[str]) -> dict:
    """Run one benchmark worker in its own process (its own peak RSS) on THREADS threads and
    return the JSON of its RESULT line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--rows", default=None, help="comma-separated row names to run")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="another kiln checkout for the 'before' rows (e.g. an earlier commit)")
    parser.add_argument("--worker", choices=["kiln", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=["fp32", "bf16"], help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.framework = args.worker
        return worker(args)

    from kiln.models.transformer import flops_per_token
    from kiln.train.metrics import measure_matmul_flops

    import transformers
    torch.set_num_threads(THREADS)

    def matmul_rates() -> dict[str, float]:
        return {p: measure_matmul_flops(d) for p, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}

    rate = matmul_rates()
    flops_tok = flops_per_token(model_config(), SEQ_LEN)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {sys.version.split()[0]}, {THREADS} threads")
    print(f"matmul 2048^3 at start: fp32 {rate['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {rate['bf16'] / 1e9:.1f} GFLOP/s")
    print(f"workload bench-7m: {flops_tok / 1e6:.2f} MFLOP/token (6N + attention), "
          f"{BATCH} x {SEQ_LEN} tokens/step, {args.warmup} warm-up + {args.steps} timed steps, "
          f"{args.rounds} rounds", flush=True)

    rows = [r for r in ROWS if (args.rows is None or r[0] in args.rows.split(","))
            and (args.before or r[1] != "before")]
    results: dict[str, list[dict]] = {name: [] for name, *_ in rows}
    for round_ in range(args.rounds):
        for name, framework, precision, compile in rows if round_ % 2 == 0 else rows[::-1]:
            r = spawn(framework, precision, compile, args.warmup, args.steps, args.before)
            results[name].append(r)
            print(f"  round {round_ + 1}  {name:<18} {r['tokens_per_s']:8,.0f} tokens/s "
                  f"({r['cpu_tokens_per_s']:6,.0f} per CPU time)  peak RSS "
                  f"{r['peak_rss_mb']:6,.0f} MB  mean loss {r['mean_loss']:.3f}", flush=True)

    # The machine's rate is the better of the two measurements: other load only lowers it.
    end_rate = matmul_rates()
    print(f"matmul 2048^3 at end: fp32 {end_rate['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {end_rate['bf16'] / 1e9:.1f} GFLOP/s")
    rate = {p: max(rate[p], end_rate[p]) for p in rate}

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    print(f"\n{'run':<18} {'tokens/s':>9} {'MFU':>6} {'per CPU time':>13} {'peak RSS MB':>12} "
          f"{'over start':>11}")
    for name, framework, precision, compile in rows:
        tps = median(name, "tokens_per_s")
        over = statistics.median(r["peak_rss_mb"] - r["rss_before_mb"] for r in results[name])
        print(f"{name:<18} {tps:9,.0f} {tps * flops_tok / rate[precision]:6.1%} "
              f"{median(name, 'cpu_tokens_per_s'):13,.0f} {median(name, 'peak_rss_mb'):12,.0f} "
              f"{over:11,.0f}")
    print("(medians over rounds of each run's median step; MFU against the better matmul rate of "
          "the run's precision;\n per CPU time: tokens per second of the process's CPU time x "
          f"{THREADS} threads, less sensitive to other load; over start: peak RSS less RSS after importing torch)")

    print(f"\n{'ratio (same round)':<30} {'tokens/s':>9} {'per round':>20} {'per CPU':>8} "
          f"{'target':>7} {'peak RSS':>9}")
    for num, den, target in RATIOS:
        if num not in results or den not in results:
            continue
        pairs = list(zip(results[num], results[den]))
        speed = statistics.median(a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs)
        cpu = statistics.median(a["cpu_tokens_per_s"] / b["cpu_tokens_per_s"] for a, b in pairs)
        mem = statistics.median(a["peak_rss_mb"] / b["peak_rss_mb"] for a, b in pairs)
        rounds = " ".join(f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" for a, b in pairs)
        print(f"{num + ' / ' + den:<30} {speed:8.2f}x {rounds:>20} {cpu:7.2f}x {'>= ' + str(target):>7} "
              f"{mem:8.2f}x  speed {'met' if speed >= target else 'NOT met'}, "
              f"memory {'met' if mem <= 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
