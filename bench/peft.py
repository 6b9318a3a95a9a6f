"""Fine-tuning throughput and memory: kiln full, LoRA and QLoRA against Hugging Face `peft`
LoRA under `transformers.Trainer`, on a ~500M-parameter Llama-shaped model on the CPU.

    .venv/bin/python bench/peft.py                      # 2 rounds, 1 warm-up + 3 timed steps each (~30 min)
    .venv/bin/python bench/peft.py --shape tiny --rounds 1   # a smoke test of the script (a minute)
    .venv/bin/python bench/peft.py --rounds 1 --rows "kiln lora" --profile   # where a step's time goes

Every run is its own subprocess (its own peak RSS) and the runs alternate within each round,
so load from other jobs falls on all of them. The same random tokens, fp32, AdamW, the same
LoRA (rank 16, alpha 32, on q/k/v/o/gate/up/down) for kiln and peft. Peak memory is reported
twice: over the whole process, and during training only (the peak is reset once the model is
built: QLoRA's build holds the fp32 base until it is quantised). Last, the FLOPs each step must
do, against this CPU's measured fp32 matmul peak: how much room any stack has. Writes nothing
but stdout.
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
from throughput import rss_mb  # noqa: E402  (bench/throughput.py, next to this file)

# This file is named peft.py: without its folder on the path, `import peft` finds the library.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

THREADS, SEED, RANK, ALPHA = 2, 0, 16, 32.0
SHAPES = {
    # Llama-shaped, ~500M parameters: 16 layers of hidden 1536, SwiGLU 4096, GQA 12/4, vocab 32000.
    "500m": dict(vocab_size=32000, dim=1536, n_layers=16, n_heads=12, n_kv_heads=4,
                 intermediate_size=4096, max_seq_len=2048),
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                 intermediate_size=192, max_seq_len=256),
}
ROWS = ["kiln full", "kiln lora", "kiln qlora", "peft lora"]
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def job(shape: str, method: str, seq_len: int):
    from kiln.config import JobConfig

    return JobConfig.model_validate({
        "model": SHAPES[shape], "data": {"seq_len": seq_len},
        "peft": {"method": method, "rank": RANK, "alpha": ALPHA},
        "train": {"seed": SEED, "num_threads": THREADS}})


def tokens(shape: str, n: int, seq_len: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(0, SHAPES[shape]["vocab_size"], (n, seq_len + 1), generator=g)


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets this process's VmHWM to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def run_kiln(method: str, args) -> tuple[list, float, int]:
    """kiln's own step (build_model with the tuning method, train_step, fused AdamW)."""
    from kiln.data.batch import Batch
    from kiln.tasks.pretrain import Pretrain
    from kiln.train.build import build_model
    from kiln.train.optim import build_optimizer
    from kiln.train.trainer import train_step

    cfg = job(args.shape, method, args.seq_len)
    data = tokens(args.shape, (args.warmup + args.steps) * args.batch, args.seq_len)
    model = build_model(cfg, None, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reset_peak_rss()
    ends, losses = [], []
    for i in range(args.warmup + args.steps):
        rows = data[i * args.batch:(i + 1) * args.batch]
        loss, _ = train_step(model, optimizer, Pretrain().loss_sum,
                             [Batch(rows[:, :-1], rows[:, 1:])], grad_clip=cfg.optim.grad_clip)
        ends.append(time.perf_counter())
        losses.append(float(loss))
    if args.profile:  # one more step under torch.profiler: where its time goes
        from torch.profiler import ProfilerActivity, profile

        rows = data[:args.batch]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            train_step(model, optimizer, Pretrain().loss_sum, [Batch(rows[:, :-1], rows[:, 1:])],
                       grad_clip=cfg.optim.grad_clip)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=12, max_shapes_column_width=60), flush=True)
    return ends, statistics.mean(losses), trainable


def run_peft(args) -> tuple[list, float, int]:
    """peft.get_peft_model on LlamaForCausalLM (SDPA), trained by transformers.Trainer."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    transformers.logging.set_verbosity_error()

    s = SHAPES[args.shape]
    data = tokens(args.shape, (args.warmup + args.steps) * args.batch, args.seq_len)[:, :args.seq_len]

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            return {"input_ids": data[i], "labels": data[i]}  # HF shifts the labels itself

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_train_begin(self, args, state, control, **kwargs):
            reset_peak_rss()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=s["vocab_size"], hidden_size=s["dim"], num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"], num_key_value_heads=s["n_kv_heads"],
        intermediate_size=s["intermediate_size"], max_position_embeddings=s["max_seq_len"],
        tie_word_embeddings=False, attn_implementation="sdpa"))
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=HF_TARGETS,
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    times = StepTimes()
    with tempfile.TemporaryDirectory() as out_dir:  # save_strategy="no": nothing is written
        targs = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=args.batch,
            max_steps=args.warmup + args.steps, use_cpu=True, report_to=[], save_strategy="no",
            logging_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
            seed=SEED, learning_rate=3e-4, max_grad_norm=1.0)
        out = Trainer(model=model, args=targs, train_dataset=Rows(), callbacks=[times]).train()
    return times.ends, out.training_loss, trainable


def worker(args) -> None:
    torch.set_num_threads(THREADS)
    start = time.perf_counter()
    if args.worker == "peft lora":
        ends, mean_loss, trainable = run_peft(args)
    else:
        ends, mean_loss, trainable = run_kiln(args.worker.split()[1], args)
    timed = ends[args.warmup - 1:]
    wall = [b - a for a, b in zip(timed, timed[1:])]
    print("RESULT " + json.dumps({
        "tokens_per_s": args.batch * args.seq_len / statistics.median(wall),
        "train_peak_mb": rss_mb("VmHWM"), "trainable": trainable, "mean_loss": mean_loss,
        "wall_s": time.perf_counter() - start}), flush=True)


def spawn(row: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", row, "--shape", args.shape, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps),
           *(["--profile"] if args.profile else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    # Peak over the whole process, build included, from the kernel's accounting of the child.
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
            "sys.exit(p.returncode)")
    out = subprocess.run([sys.executable, "-c", code, *cmd], capture_output=True, text=True, env=env)
    result = None
    for line in out.stdout.splitlines():
        if args.profile and not line.startswith(("RESULT ", "MAXRSS ")):
            print(line)
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        elif line.startswith("MAXRSS ") and result is not None:
            result["process_peak_mb"] = int(line.split()[1]) / 1024
    if result is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return result


def gemm_rate(m: int, k: int, n: int, repeats: int = 5) -> float:
    """Best FLOP/s of an (m x k) @ (k x n) fp32 matmul over `repeats` runs after one warm-up."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="500m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=ROWS,
                        help="which runs (default: all; the ratios need their rows)")
    parser.add_argument("--profile", action="store_true",
                        help="kiln rows: print torch.profiler's table of one more step")
    parser.add_argument("--worker", choices=ROWS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import peft
    import torchao
    import transformers

    from kiln.config import ModelConfig
    from kiln.models.transformer import count_parameters, flops_per_token
    from kiln.train.metrics import measure_matmul_flops

    model_cfg = ModelConfig(**SHAPES[args.shape])
    n = count_parameters(model_cfg)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft "
          f"{peft.__version__}, torchao {torchao.__version__}, python {sys.version.split()[0]}, "
          f"{THREADS} threads")
    print(f"model {args.shape}: {n / 1e6:.0f}M parameters; {args.batch} x {args.seq_len} tokens/step, "
          f"fp32, {args.warmup} warm-up + {args.steps} timed steps, {args.rounds} rounds", flush=True)
    rows = [row for row in ROWS if row in args.rows]
    results: dict[str, list[dict]] = {row: [] for row in rows}
    for round_ in range(args.rounds):
        for row in rows if round_ % 2 == 0 else rows[::-1]:
            r = spawn(row, args)
            results[row].append(r)
            print(f"  round {round_ + 1}  {row:<11} {r['tokens_per_s']:8.1f} tokens/s  training peak "
                  f"{r['train_peak_mb']:7,.0f} MB  process peak {r['process_peak_mb']:7,.0f} MB  "
                  f"trainable {r['trainable'] / 1e6:.2f}M  ({r['wall_s']:.0f} s)", flush=True)

    def median(row: str, key: str) -> float:
        return statistics.median(r[key] for r in results[row])

    print(f"\n{'run':<11} {'tokens/s':>9} {'training peak MB':>17} {'process peak MB':>16} {'trainable':>10}")
    for row in rows:
        print(f"{row:<11} {median(row, 'tokens_per_s'):9.1f} {median(row, 'train_peak_mb'):17,.0f} "
              f"{median(row, 'process_peak_mb'):16,.0f} {median(row, 'trainable') / 1e6:9.2f}M")

    # Is there room? The FLOPs a step must do against the best this CPU's fp32 matmuls reach:
    # kiln's MFU peak (one thread's best x threads, an ideal) and the best rate of the step's
    # own big matmuls (tokens x hidden x SwiGLU, either way, and the output layer) on THREADS threads.
    torch.set_num_threads(THREADS)
    ideal = measure_matmul_flops(torch.float32, budget_s=3.0)
    m, d, f = args.batch * args.seq_len, model_cfg.dim, model_cfg.intermediate_size
    peak = max(gemm_rate(m, k, n) for k, n in ((d, f), (f, d), (d, model_cfg.vocab_size)))
    full = flops_per_token(model_cfg, args.seq_len)
    attention = 12 * model_cfg.n_layers * model_cfg.n_heads * model_cfg.head_size * args.seq_len
    frozen = (full - attention) / 6  # matmul weights a token goes through
    adapter = next((median(row, "trainable") for row in rows if row != "kiln full"), 0)
    # Adapters: forward, and the backward to the activations only (no weight gradients of the
    # base), plus the adapters' own 6 FLOPs per weight.
    lora = 4 * frozen + attention + 6 * adapter
    work = {"kiln full": full, "kiln lora": lora, "kiln qlora": lora, "peft lora": lora}
    print(f"\nFLOPs per token: full fine-tuning {full / 1e9:.3g} G, LoRA {lora / 1e9:.3g} G. This "
          f"CPU's fp32 matmuls: {peak / 1e9:.0f} GFLOP/s at best on this model's shapes with "
          f"{THREADS} threads ({ideal / 1e9:.0f} GFLOP/s ideal: one thread's best x {THREADS})")
    for row in rows:
        rate = median(row, "tokens_per_s") * work[row]
        print(f"  {row:<11} {rate / 1e9:6.1f} GFLOP/s = {rate / peak:4.0%} of that best "
              f"({rate / ideal:.0%} of the ideal)")

    def ratio(a: str, b: str, key: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(results[a], results[b]))

    if {"kiln lora", "peft lora"} <= set(rows):
        needed = 1.5 * median("peft lora", "tokens_per_s") * lora
        print(f"  1.5x peft's tokens/s would need {needed / 1e9:.1f} GFLOP/s = {needed / peak:.0%} "
              f"of that best ({needed / ideal:.0%} of the ideal)")
        speed = ratio("kiln lora", "peft lora", "tokens_per_s")
        memory = ratio("kiln lora", "peft lora", "train_peak_mb")
        print(f"\nkiln lora / peft lora: {speed:.2f}x tokens/s (target >= 1.5: "
              f"{'met' if speed >= 1.5 else 'NOT met'}), {memory:.2f}x training peak memory "
              f"(target <= 1: {'met' if memory <= 1 else 'NOT met'})")
    if {"kiln qlora", "kiln full"} <= set(rows):
        qlora = ratio("kiln qlora", "kiln full", "train_peak_mb")
        qlora_process = ratio("kiln qlora", "kiln full", "process_peak_mb")
        print(f"kiln qlora / kiln full: {qlora:.2f}x training peak memory (target < 0.5: "
              f"{'met' if qlora < 0.5 else 'NOT met'}); {qlora_process:.2f}x over the whole process")


if __name__ == "__main__":
    main()
