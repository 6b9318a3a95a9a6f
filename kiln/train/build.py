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
from kiln.checkpoint.storage import Storage
from kiln.checkpoint.hf_import import load_hf_weights, resolve_init_from
from kiln.config import BatchPlan, JobConfig, plan_batch
from kiln.data.pipeline import Data
from kiln.errors import KilnError
from kiln.models.moe import update_expert_biases
from kiln.models.transformer import Transformer
from kiln.parallel import parallelize
from kiln.parallel.pipeline import Pipeline, StageSpec, build_pipeline
from kiln.peft import apply_tuning, check_layout, finalize_tuning, record_run, trainable_parameters
from kiln.parallel.mesh import (Layout, build_mesh, device_for_rank, dp_group, dp_rank_size, rank_world,
                                resolve_layout)
from kiln.tasks import build_task
from kiln.train.device import resolve_device
from kiln.train.optim import build_optimizer
from kiln.train.precision import Precision, autocast, describe_precision, detect_hardware, grad_scaler, resolve_precision
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
    precision: Precision
    """The resolved choice (precision.dtype auto -> what this hardware runs natively)."""
    precision_record: dict
    scaler: object
    """A GradScaler for fp16, else None."""
    checkpointer: Checkpointer
    resumed: Resumed | None
    rank: int
    pipeline: Pipeline | None = None
    """This rank's pipeline stages and schedule when parallel.pp > 1 (model is then their view)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes the run directory's files."""
        return self.rank == 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: JobConfig, resume: str = "auto") -> Run:
    cfg = resolve_init_from(cfg)
    tcfg = cfg.train
    rank, world = rank_world()
    device_type = resolve_device(tcfg.device).type
    layout = resolve_layout(cfg.parallel, world, cfg.model, cfg.data.seq_len, device_type)
    check_layout(cfg, layout)
    device = device_for_rank(device_type) if world > 1 else resolve_device(tcfg.device)
    torch.set_num_threads(tcfg.num_threads or max(1, (os.cpu_count() or 1) // _local_world()))
    seed_everything(tcfg.seed)
    mesh = build_mesh(layout, device.type)
    plan = plan_batch(cfg, layout.dp)
    run_dir = cfg.run_dir
    if rank == 0:
        preflight(cfg)
    hardware = detect_hardware(device)
    precision = resolve_precision(cfg.precision, hardware)
    if layout.pp > 1 and cfg.tracking.eval_tasks:
        raise KilnError("parallel.pp > 1 with tracking.eval_tasks: the evaluation tasks run the "
                        "whole model's forward, which a pipeline stage does not have; use pp: 1")
    if layout.pp > 1 and precision.needs_grad_scaler:
        raise KilnError("parallel.pp > 1 with fp16 precision: the pipeline schedules run backward "
                        "themselves and take no gradient scaler; use bf16 (or fp32)")
    if rank == 0:
        print(f"kiln: {precision.summary}", flush=True)
        if precision.warning:
            print(f"kiln: warning: {precision.warning}", flush=True)
    # The run's config records what runs; the metrics log records why.
    cfg = cfg.model_copy(update={"precision": cfg.precision.model_copy(update={"dtype": precision.dtype})})

    task = build_task(cfg.task)
    dp_rank, dp_size = dp_rank_size(mesh)
    # Rank 0 prepares shared files (tokenizer, shards) first; the others then find them done.
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        data = task.build_data(cfg, run_dir, dp_rank, dp_size)
    if world > 1:
        dist.barrier()
    if rank != 0:
        data = task.build_data(cfg, run_dir, dp_rank, dp_size)

    pipeline = None
    if layout.pp > 1:
        pipeline = build_pipeline(cfg, mesh, device, plan.micro_batch_size * plan.grad_accum_steps,
                                  plan.grad_accum_steps,
                                  lambda spec: build_model(cfg, mesh, device, hardware, spec))
        model = pipeline.model
    else:
        model = build_model(cfg, mesh, device, hardware)
    optimizer = build_optimizer(model, cfg.optim, cfg.peft.loraplus_lr_ratio)
    if cfg.model.moe is not None and cfg.model.moe.bias_update_rate > 0:
        # DeepSeek's balancing biases move after every optimizer step, from that step's loads.
        group = dp_group(mesh)
        optimizer.register_step_post_hook(lambda *_: update_expert_biases(model, group))
    schedule = LRSchedule(optimizer, cfg.optim.lr, cfg.schedule, plan.total_steps or 1)
    checkpointer = Checkpointer(cfg, run_dir, model, optimizer, schedule, data.train)
    resumed = checkpointer.restore(resume)
    record_run(cfg, run_dir, trainable_parameters(model), task.name, resumed and resumed.files,
               resumed and resumed.source, write=rank == 0)
    if rank == 0:  # written once the run is known to start
        (run_dir / "config.yaml.tmp").write_text(cfg.to_yaml())
        (run_dir / "config.yaml.tmp").replace(run_dir / "config.yaml")
    return Run(cfg, run_dir, device, layout, mesh, plan, model, optimizer, schedule, task, data,
               autocast(precision, device), precision, describe_precision(precision, hardware),
               grad_scaler(precision, device), checkpointer, resumed, rank, pipeline)


def preflight(cfg: JobConfig) -> None:
    """What can stop a run, checked before anything is written: the run directory can be made,
    and the checkpoint directory is reachable and writable (a small probe object)."""
    for path in (cfg.run_dir, *cfg.run_dir.parents):
        if path.exists() and not path.is_dir():
            raise KilnError(f"the run directory {cfg.run_dir} (out_dir/name) cannot be made: "
                            f"{path} is a file; set out_dir or name to another place")
    if cfg.checkpoint.enabled:
        Storage(cfg.checkpoint.dir or str(cfg.run_dir / "checkpoints"), cfg.checkpoint.endpoint_url).probe()


def build_model(cfg: JobConfig, mesh, device: torch.device, hardware=None,
                stage: StageSpec | None = None) -> nn.Module:
    """The model built on the meta device (no memory), parallelised, then materialised on
    `device` with each rank holding only its shards, and initialised or loaded. With `stage`,
    only that pipeline stage's parts."""
    with torch.device("meta"):
        model = Transformer(cfg.model)
    if stage is not None:
        model = stage.cut(model)
    if cfg.precision.dtype == "fp8":  # before tensor parallel, compile and FSDP (torchtitan's order)
        from kiln.parallel.float8 import convert_to_float8

        shard = mesh is not None and mesh["dp_shard"].size() > 1
        convert_to_float8(model, cfg.precision, hardware or detect_hardware(device),
                          fsdp_float8_all_gather=cfg.precision.fp8_recipe == "tensorwise" and shard)
    apply_tuning(model, cfg, shards=1 if mesh is None else mesh["dp_shard"].size())
    parallelize(model, mesh, cfg)
    model.to_empty(device=device)
    model.tie_weights()
    model.init_weights(cfg.train.seed)
    if cfg.model.init_from:
        load_hf_weights(model, cfg.model.init_from)
    finalize_tuning(model, cfg)
    return model


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))
