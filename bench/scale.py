"""Scale-out figures: the quickstart on 1 and 2 CPU processes, and per-rank memory of a ~500M
model under FSDP2 against plain data parallel.

    .venv/bin/python bench/scale.py                 # both parts
    .venv/bin/python bench/scale.py --part memory   # one part: throughput | memory

throughput: `kiln train configs/quickstart.yaml` through the real CLI, 1 process (2 threads)
and `--nproc 2` (FSDP2, 1 thread each), the same global batch (16 x 256 tokens) and steps;
tokens/s of the last logged window and peak memory per rank from metrics.jsonl.

memory: the qwen2.5-0.5b shape (494M parameters) built on the meta device and parallelised
under torchrun with N gloo ranks: plain data parallel (dp_replicate=N), FSDP2 (dp_shard=N). The
bytes are those of each rank's local shards (DTensor.to_local) of the parameters, their
gradients and AdamW's two moments, all float32: what `to_empty`, FSDP2's reduce-scatter and
AdamW allocate. Counted on meta tensors, so nothing is allocated and a 2-core machine can show
4 ranks; activations and FSDP2's transient all-gather buffers are not included.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def throughput() -> None:
    out = Path(tempfile.mkdtemp(prefix="kiln-scale-"))
    common = ["--set", f"out_dir={out}", "--set", f"train.max_steps={STEPS}", "--set", "train.max_time=null",
              "--set", "train.log_interval=10", "--set", "train.eval_interval=1000",
              "--set", "train.sample_tokens=0", "--set", "checkpoint.enabled=false",
              "--set", "train.micro_batch_size=8", "--set", "train.global_batch_size=16",
              "--set", "metrics.progress_bar=off", "--resume", "none"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for nproc, threads in ((1, 2), (2, 1)):
        cmd = [sys.executable, "-m", "kiln", "train", "configs/quickstart.yaml", *common,
               "--set", f"train.num_threads={threads}"] + (["--nproc", str(nproc)] if nproc > 1 else [])
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (out / "quickstart/metrics.jsonl").read_text().splitlines()]
        last = [r for r in records if "tokens_per_s" in r][-1]
        memory = list(last.get("peak_mem_mb_per_rank", {"0": last["peak_mem_mb"]}).values())
        print(f"| quickstart, {nproc} process{'es' if nproc > 1 else ''} x {threads} thread(s) | "
              f"{last['tokens_per_s']:,.0f} tokens/s | peak memory per rank (MB): "
              f"{', '.join(f'{m:,.0f}' for m in memory)} |", flush=True)


WORKER = r"""
import json, sys
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from kiln.config import JobConfig
from kiln.models.transformer import Transformer
from kiln.parallel import parallelize
from kiln.parallel.mesh import build_mesh, resolve_layout

dist.init_process_group("gloo")
world = dist.get_world_size()
rows = []
for name, parallel in (("data parallel", {"dp_replicate": world, "dp_shard": 1}),
                       ("FSDP2", {"dp_shard": world})):
    cfg = JobConfig.model_validate({"model": {"preset": "qwen2.5-0.5b"}, "data": {"seq_len": 256},
                                    "parallel": parallel})
    mesh = build_mesh(resolve_layout(cfg.parallel, world, cfg.model, 256, "cpu"), "cpu")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, mesh, cfg)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    # float32 parameters + gradients + AdamW's exp_avg and exp_avg_sq, each the parameter's shape
    rows.append({"layout": name, "ranks": world, "params": total, "bytes_per_rank": 4 * 4 * local})
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(rows))
dist.destroy_process_group()
"""


def memory() -> None:
    script = Path(tempfile.mkdtemp(prefix="kiln-scale-")) / "memory_worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    single = None
    for world in (2, 4):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc-per-node={world}", str(script)], cwd=ROOT, env=env,
                              check=True, capture_output=True, text=True)
        rows = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
        for row in rows:
            single = single or row["bytes_per_rank"]  # data parallel holds the whole state
            print(f"| {row['params'] / 1e6:.0f}M params, {row['layout']}, {row['ranks']} ranks | "
                  f"{row['bytes_per_rank'] / 2**30:.2f} GiB per rank | "
                  f"{row['bytes_per_rank'] / single:.3f} of one replica |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["throughput", "memory", "all"], default="all")
    part = parser.parse_args().part
    if part in ("memory", "all"):
        memory()
    if part in ("throughput", "all"):
        throughput()
