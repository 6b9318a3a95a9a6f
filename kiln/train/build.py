"""Everything a run needs, built in order: config -> mesh -> model on the meta device ->
tuning method -> parallelize -> materialise and initialise or load -> task data -> optimizer,
schedule, checkpointer."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kiln.checkpoint.checkpointer import Checkpointer, Resumed
from kiln.checkpoint.hf_import import load_hf_weights, resolve_init_from
from kiln.config import BatchPlan, JobConfig, plan_batch
from kiln.data.pipeline import Data
from kiln.errors import KilnError
from kiln.models.moe import update_expert_biases
from kiln.models.transformer import Transformer
from kiln.parallel import parallelize
from kiln.parallel.mesh import (Layout, build_mesh, device_for_rank, dp_group, dp_rank_size, rank_world,
                                resolve_layout)
from kiln.tasks import build_task
from kiln.train.optim import build_optimizer
from kiln.train.precision import autocast
from kiln.train.schedule import LRSchedule


@dataclass
class Run:
    cfg: JobConfig
    run_dir: Path
    device: torch.device
    layout: Layout
    mesh: object
    """The DeviceMesh, or None in one process."""
    plan: BatchPlan
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    task: object
    data: Data
    amp: object
    checkpointer: Checkpointer
    resumed: Resumed | None
    rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes the run directory's files."""
        return self.rank == 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise KilnError(f"train.device {name!r} is not a device name ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"train.device {name!r}, but this machine has no usable CUDA device; "
                        "set train.device: cpu (or auto)")
    return device


def build(cfg: JobConfig, resume: str = "auto") -> Run:
    cfg = resolve_init_from(cfg)
    tcfg = cfg.train
    rank, world = rank_world()
    device_type = resolve_device(tcfg.device).type
    layout = resolve_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, device_type)
    if layout.pp > 1:
        raise KilnError("parallel.pp > 1: pipeline parallel training is not wired into the "
                        "trainer yet; use dp_shard/dp_replicate/tp")
    device = device_for_rank(device_type) if world > 1 else resolve_device(tcfg.device)
    torch.set_num_threads(tcfg.num_threads or max(1, (os.cpu_count() or 1) // _local_world()))
    seed_everything(tcfg.seed)
    mesh = build_mesh(layout, device.type)
    plan = plan_batch(cfg, layout.dp)
    run_dir = cfg.run_dir

    task = build_task("pretrain")
    dp_rank, dp_size = dp_rank_size(mesh)
    # Rank 0 prepares shared files (tokenizer, shards) first; the others then find them done.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        data = task.build_data(cfg, run_dir, dp_rank, dp_size)
    if world > 1:
        dist.barrier()
    if rank != 0:
        data = task.build_data(cfg, run_dir, dp_rank, dp_size)

    model = build_model(cfg, mesh, device)
    optimizer = build_optimizer(model, cfg.optim)
    if cfg.model.moe is not None and cfg.model.moe.bias_update_rate > 0:
        # DeepSeek's balancing biases move after every optimizer step, from that step's loads.
        group = dp_group(mesh)
        optimizer.register_step_post_hook(lambda *_: update_expert_biases(model, group))
    schedule = LRSchedule(optimizer, cfg.optim.lr, cfg.schedule, plan.total_steps or 1)
    checkpointer = Checkpointer(cfg, run_dir, model, optimizer, schedule, data.train)
    resumed = checkpointer.restore(resume)
    if rank == 0:  # written once the run is known to start
        (run_dir / "config.yaml.tmp").write_text(cfg.to_yaml())
        (run_dir / "config.yaml.tmp").replace(run_dir / "config.yaml")
    return Run(cfg, run_dir, device, layout, mesh, plan, model, optimizer, schedule, task, data,
               autocast(cfg.precision, device), checkpointer, resumed, rank)


def build_model(cfg: JobConfig, mesh, device: torch.device) -> nn.Module:
    """The model built on the meta device (no memory), parallelised, then materialised on
    `device` with each rank holding only its shards, and initialised or loaded."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(cfg.train.seed)
    if cfg.model.init_from:
        load_hf_weights(model, cfg.model.init_from)
    return model


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
