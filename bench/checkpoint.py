"""How long the training loop is blocked by each checkpoint save, with checkpoint.async off and on.

    .venv/bin/python bench/checkpoint.py                  # quickstart model and a ~500M model
    .venv/bin/python bench/checkpoint.py --models quickstart --saves 5

For each model: build it on the CPU with AdamW state (one real step), then call the same
Checkpointer.save the training loop calls, `--saves` times per mode, into a fresh local
directory. "blocked" is the time save() takes (what the loop waits for); "committed" is the
time until the commit marker is written (sync: the same; async: the background upload too).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kiln.checkpoint.checkpointer import Checkpointer, Progress
from kiln.config import JobConfig
from kiln.models.transformer import Transformer, count_parameters
from kiln.train.optim import build_optimizer

MODELS = {
    "quickstart": {"preset": "quickstart"},
    # ~0.5B parameters, Llama-shaped (untied 32k vocabulary).
    "500m": dict(vocab_size=32000, dim=1280, n_layers=22, n_heads=20, n_kv_heads=4,
                 intermediate_size=3840, max_seq_len=256, tie_embeddings=False),
}


class Position:
    """Stands in for the data loader: a small state dict."""

    def state_dict(self) -> dict:
        return {"epoch": 0, "position": 1234}

    def load_state_dict(self, state: dict) -> None:
        pass


def bench(name: str, saves: int, root: Path) -> list[dict]:
    rows = []
    for async_save in (False, True):
        cfg = JobConfig.model_validate({
            "model": MODELS[name], "data": {"seq_len": 16},
            "checkpoint": {"dir": str(root / f"{name}-{async_save}"), "keep_last": 1,
                           "async": async_save}})
        model = Transformer(cfg.model)
        model.init_weights(0)
        optimizer = build_optimizer(model, cfg.optim)
        x = torch.randint(0, cfg.model.vocab_size, (1, 16))
        model(x).float().square().mean().backward()  # one real step: AdamW state exists
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        ckpt = Checkpointer(cfg, root, model, optimizer, scheduler, Position())
        blocked, committed = [], []
        for i in range(1, saves + 1):
            start = time.perf_counter()
            ckpt.save(Progress(step=i))
            blocked.append(time.perf_counter() - start)
            ckpt.wait()
            committed.append(time.perf_counter() - start)
        ckpt.close()
        size = sum(f.stat().st_size for f in (root / f"{name}-{async_save}").rglob("*") if f.is_file())
        rows.append({"model": name, "params_m": count_parameters(cfg.model) / 1e6,
                     "async": async_save, "size_gb": size / 1e9,
                     "blocked_s": statistics.median(blocked), "committed_s": statistics.median(committed)})
        shutil.rmtree(root / f"{name}-{async_save}")
        del model, optimizer, ckpt
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kiln-bench-ckpt-"))
    print("| model | params | checkpoint | async | loop blocked per save | until committed |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        for r in bench(name, args.saves if name == "quickstart" else min(args.saves, 2), root):
            print(f"| {r['model']} | {r['params_m']:.0f}M | {r['size_gb']:.2f} GB | "
                  f"{'on' if r['async'] else 'off'} | {r['blocked_s']:.3f} s | "
                  f"{r['committed_s']:.3f} s |", flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
