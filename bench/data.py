"""Data pipeline throughput: tokenization (kiln prepare) and the shard loader vs the trainer.

    .venv/bin/python bench/data.py                  # ~2 min on 2 cores
    .venv/bin/python bench/data.py --max-mb 8       # a quick look

The corpus is this machine's: the Python standard library's source (the quickstart's text),
with the quickstart's tokenizer (byte-level BPE, 8192 tokens, trained here on the same text).
Figures:
  1. tokenization, one process, tokenizers' own threads off: tokens/s per core;
  2. `kiln prepare` end to end (read, tokenize in N worker processes, write shards): tokens/s;
  3. the loader: (16, 256) batches from the memory-mapped shards, shuffled, no read-ahead;
  4. the trainer's consumption: tokens/s of training steps on the quickstart model (bf16).
Writes its shards to a temporary directory and removes it; prints the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # figure 1 is per core: one thread

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Only light imports at the top: prepare's worker processes are spawned, and each re-imports
# this script; torch is imported inside main().
from kiln.data.corpus import load_stdlib_corpus  # noqa: E402
from kiln.data.prepare import PrepareOptions, prepare  # noqa: E402
from kiln.data.shards import PackedSamples, ShardSet  # noqa: E402
from kiln.data.tokenizer import describe, train_bpe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-mb", type=float, default=None, help="read at most this much text")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--train-steps", type=int, default=6)
    args = parser.parse_args()
    max_bytes = int(args.max_mb * 2**20) if args.max_mb else None
    corpus = load_stdlib_corpus(0.05, max_bytes)
    texts = corpus.train
    chars = sum(len(t) for t in texts)
    print(f"corpus: {len(texts):,} stdlib files, {chars / 2**20:.1f} MiB of text; "
          f"{os.cpu_count()} cores")

    start = time.perf_counter()
    info = describe(train_bpe(texts, 8192))
    print(f"tokenizer: trained 8192-token BPE in {time.perf_counter() - start:.1f} s")

    start, cpu = time.perf_counter(), time.process_time()
    ids = info.encode_documents(texts)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n_tokens = sum(len(i) for i in ids)
    print(f"1. tokenization, 1 process, 1 thread: {n_tokens:,} tokens in {elapsed:.2f} s wall, "
          f"{cpu:.2f} s CPU = {n_tokens / cpu / 1e6:.2f} M tokens per CPU-second "
          f"({n_tokens / elapsed / 1e6:.2f} M/s wall on a shared machine, load {os.getloadavg()[0]:.1f})")

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = root / "corpus"
        src.mkdir()
        for i, text in enumerate(texts):
            (src / f"{i:05d}.txt").write_text(text)
        start, cpu = time.perf_counter(), _cpu_seconds()
        prepare([str(src)], info, root / "shards",
                PrepareOptions(progress=False, workers=args.workers, shard_tokens=4_000_000))
        elapsed, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
        shards = ShardSet(root / "shards")
        print(f"2. kiln prepare, {args.workers} workers, end to end: {shards.total_tokens:,} tokens "
              f"in {elapsed:.2f} s = {shards.total_tokens / elapsed / 1e6:.2f} M tokens/s wall; "
              f"{shards.total_tokens / cpu / 1e6:.2f} M tokens per CPU-second (all processes, "
              f"worker start-up included), {len(shards.shards)} shards")

        import numpy as np
        import torch

        from kiln.config import JobConfig
        from kiln.data.loader import ShardLoader
        from kiln.data.sampler import Sampler, Stage

        cfg = JobConfig.model_validate({"model": {"preset": "quickstart"},
                                        "data": {"seq_len": 256},
                                        "train": {"micro_batch_size": 16}, "precision": {"dtype": "bf16"}})
        seq_len, batch = cfg.data.seq_len, cfg.train.micro_batch_size
        samples = PackedSamples(shards, seq_len)
        loader = ShardLoader([samples], ["stdlib"],
                             Sampler([len(samples)], [Stage(2**62, np.ones(1))], 0, batch),
                             prefetch=0)
        next(loader)
        n, start = 200, time.perf_counter()
        for _ in range(n):
            next(loader)
        loader_tps = n * batch * seq_len / (time.perf_counter() - start)
        print(f"3. loader, ({batch}, {seq_len}) shuffled batches from mmap, no read-ahead: "
              f"{loader_tps / 1e6:.2f} M tokens/s ({n / (time.perf_counter() - start):,.0f} batches/s)")

        train_tps = trainer_tokens_per_s(cfg, loader, args.train_steps)
        print(f"4. trainer, quickstart model, bf16, 2 threads, torch {torch.__version__}: "
              f"{train_tps:,.0f} tokens/s consumed")
        print(f"loader / trainer: {loader_tps / train_tps:,.0f}x: the trainer does not wait on data")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def trainer_tokens_per_s(cfg, loader, steps: int) -> float:
    import torch

    from kiln.models.transformer import Transformer
    from kiln.train.optim import build_optimizer
    from kiln.train.precision import autocast
    from kiln.data.batch import Batch
    from kiln.tasks.pretrain import Pretrain
    from kiln.train.trainer import train_step

    torch.set_num_threads(2)
    model = Transformer(cfg.model)
    model.init_weights(0)
    optimizer = build_optimizer(model, cfg.optim)
    amp = autocast(cfg.precision, torch.device("cpu"))
    train_step(model, optimizer, Pretrain().loss_sum, [next(loader)], amp)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, Pretrain().loss_sum, [next(loader)], amp)
    return steps * cfg.train.micro_batch_size * cfg.data.seq_len / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
