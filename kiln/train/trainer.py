"""The training loop: config -> model -> parallelize -> data -> steps -> metrics and weights."""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_model
from torch import nn

from kiln.checkpoint.checkpointer import Checkpointer, Progress
from kiln.checkpoint.hf_import import load_hf_weights
from kiln.config import JobConfig
from kiln.data.pipeline import Data, build_data
from kiln.models.transformer import Transformer, count_parameters, flops_per_token
from kiln.parallel import parallelize
from kiln.train.metrics import MetricsLog, peak_flops, peak_memory_mb
from kiln.train.optim import build_optimizer
from kiln.train.precision import autocast
from kiln.train.schedule import lr_multiplier

IGNORE_INDEX = -100


@dataclass
class TrainResult:
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    peak_mem_mb: float = 0.0
    start_step: int = 0
    """The step this process started from: 0, or the checkpoint it resumed."""
    sample: str = ""
    tokens_by_source: dict[str, int] = field(default_factory=dict)
    """Training tokens read from each data source, over all ranks."""


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, amp,
               grad_clip: float | None) -> tuple[float, float]:
    """One optimizer step over micro-batches; returns (mean loss per token, grad norm)."""
    # Normalise by the step's count of real targets, so accumulating micro-batches gives the
    # same update as one big batch.
    n_targets = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
    total = torch.zeros((), device=batches[0][0].device)
    for x, y in batches:
        with amp:
            loss = model(x, y) / n_targets  # the model's fused head + loss: no full logits
        loss.backward()
        total += loss.detach()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total.item(), grad_norm.item()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, amp) -> float:
    model.eval()
    loss_sum, count = 0.0, 0
    for x, y in batches:
        with amp:
            loss_sum += model(x, y).item()
        count += int((y != IGNORE_INDEX).sum())
    model.train()
    return loss_sum / count


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train(cfg: JobConfig, resume: str = "auto") -> TrainResult:
    """Train as cfg says; resume: 'auto' (the newest committed checkpoint), 'none' or a path."""
    tcfg = cfg.train
    seed_everything(tcfg.seed)
    torch.set_num_threads(tcfg.num_threads or os.cpu_count() or 1)
    device = resolve_device(tcfg.device)
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml.tmp").write_text(cfg.to_yaml())
    (run_dir / "config.yaml.tmp").replace(run_dir / "config.yaml")

    data = build_data(cfg, run_dir)
    model = Transformer(cfg.model)
    model.init_weights(torch.Generator().manual_seed(tcfg.seed))
    if cfg.model.init_from:
        load_hf_weights(model, cfg.model.init_from)
    model = parallelize(model.to(device), tcfg)
    optimizer = build_optimizer(model, cfg.optim)
    tokens_per_step = tcfg.micro_batch_size * tcfg.grad_accum_steps * cfg.data.seq_len
    total_steps = tcfg.max_steps or (tcfg.max_tokens // tokens_per_step if tcfg.max_tokens else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_multiplier(cfg.schedule, total_steps or 1))
    amp = autocast(cfg.precision, device)
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(device, torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32,
                      cfg.metrics.peak_tflops)
    ckpt = Checkpointer(cfg, run_dir, model, optimizer, scheduler, data.train)
    resumed = ckpt.restore(resume)
    progress = resumed.progress if resumed else Progress()
    if resumed is None:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run; a resumed one appends
    log = MetricsLog(run_dir / "metrics.jsonl", total_steps, cfg.metrics.progress_bar, progress.step)
    if resumed:
        log.log({"step": progress.step, "resumed_from": resumed.source,
                 "config_changes": resumed.changes})
    print(f"kiln: {count_parameters(cfg.model) / 1e6:.1f}M parameters, {data.train_tokens:,} "
          f"training tokens, {tokens_per_step:,} tokens/step, device {device}, run dir {run_dir}",
          flush=True)

    result = TrainResult()
    val_sets = {name: [(x.to(device), y.to(device)) for x, y in batches]
                for name, batches in (data.val_sets or {"val": data.val}).items()}

    def run_eval(step: int) -> None:
        record = {"step": step}
        for i, (name, batches) in enumerate(val_sets.items()):
            loss = evaluate(model, batches, amp)
            if i == 0:  # the first set is the run's headline val_loss
                result.val_losses.append((step, loss))
                record.update(val_loss=loss, val_ppl=math.exp(min(loss, 50)))
            if len(val_sets) > 1:
                record.update({f"val/{name}_loss": loss, f"val/{name}_ppl": math.exp(min(loss, 50))})
        log.log(record)

    result.start_step = step = progress.step
    result.tokens = progress.tokens
    done = budget_spent(tcfg, step, result.tokens, progress.elapsed)
    if resumed is None or done:
        run_eval(step)
    start = window_start = time.perf_counter()
    window_tokens = 0
    while not done:
        batches = [tuple(t.to(device, non_blocking=True) for t in next(data.train))
                   for _ in range(tcfg.grad_accum_steps)]
        loss, grad_norm = train_step(model, optimizer, batches, amp, cfg.optim.grad_clip)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        step += 1
        result.tokens += tokens_per_step
        window_tokens += tokens_per_step
        result.losses.append(loss)
        log.advance(1, loss)
        elapsed = progress.elapsed + time.perf_counter() - start
        done = budget_spent(tcfg, step, result.tokens, elapsed)
        if step % tcfg.log_interval == 0 or done:
            now = time.perf_counter()
            tps = window_tokens / (now - window_start)
            result.tokens_per_s.append(tps)
            log.log({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                     "tokens_per_s": tps, "mfu": tps * flops_tok / peak,
                     "peak_mem_mb": peak_memory_mb(device), "tokens": result.tokens})
            window_start, window_tokens = time.perf_counter(), 0
        if step % tcfg.eval_interval == 0 or done:
            run_eval(step)
            window_start = time.perf_counter()  # evaluation time is not training throughput
        ckpt.maybe_save(Progress(step, result.tokens, elapsed), final=done)

    ckpt.close()  # the last save, if it runs in the background, is waited for
    result.steps, result.peak_mem_mb = step, peak_memory_mb(device)
    data.train.close()
    result.tokens_by_source = data.train.tokens_by_source()
    log.log({"step": step, "tokens_by_source": result.tokens_by_source})
    log.close()
    save_weights(model, run_dir)
    result.sample = sample(model, data, tcfg, amp, device)
    return result


def budget_spent(tcfg, step: int, tokens: int, elapsed: float) -> bool:
    return bool((tcfg.max_steps and step >= tcfg.max_steps)
                or (tcfg.max_tokens and tokens >= tcfg.max_tokens)
                or (tcfg.max_time and elapsed >= tcfg.max_time))


def save_weights(model: nn.Module, run_dir) -> None:
    tmp = run_dir / "model.safetensors.tmp"
    save_model(model, str(tmp))
    tmp.replace(run_dir / "model.safetensors")


def sample(model: Transformer, data: Data, tcfg, amp, device: torch.device) -> str:
    if tcfg.sample_tokens == 0:
        return ""
    prompt = torch.tensor([data.tokenizer.encode(tcfg.sample_prompt).ids], device=device)
    model.eval()
    with amp:
        out = model.generate(prompt, tcfg.sample_tokens,
                             generator=torch.Generator(device).manual_seed(tcfg.seed))
    return data.tokenizer.decode(out[0].tolist())
