"""The training loop: Trainer.fit runs optimizer steps over the parts kiln.train.build made."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from kiln.checkpoint.checkpointer import Progress
from kiln.config import JobConfig
from kiln.data.batch import Batch
from kiln.models.transformer import count_parameters, flops_per_token
from kiln.parallel.mesh import dp_group
from kiln.train.build import Run, build
from kiln.train.metrics import MetricsLog, peak_flops, peak_memory_mb


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


def train(cfg: JobConfig, resume: str = "auto") -> TrainResult:
    """Train as cfg says; resume: 'auto' (the newest committed checkpoint), 'none' or a path."""
    return Trainer(build(cfg, resume)).fit()


class Trainer:
    def __init__(self, run: Run):
        self.run = run
        self.cfg, self.model, self.optimizer = run.cfg, run.model, run.optimizer
        self.dp_group = dp_group(run.mesh)

    # -- one step ------------------------------------------------------------------------------

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """This rank's share of the step's mean loss, on the device; the seam a pipeline
        schedule replaces."""
        return forward_backward(self.model, self.run.task.loss_sum, batches, self.run.amp, self.dp_group)

    def train_step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        return train_step(self.model, self.optimizer, self.run.task.loss_sum, batches,
                          self.run.amp, self.cfg.optim.grad_clip, self.dp_group)

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        run, cfg, tcfg = self.run, self.cfg, self.cfg.train
        progress = run.resumed.progress if run.resumed else Progress()
        log = self._open_log(progress)
        flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
        peak = peak_flops(run.device, torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32,
                          cfg.metrics.peak_tflops) * run.layout.world_size
        result = TrainResult(start_step=progress.step, tokens=progress.tokens)
        step = progress.step
        done = budget_spent(tcfg, step, result.tokens, progress.elapsed)
        if run.resumed is None or done:
            self._evaluate(step, log, result)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # read at the next log line
        start = window_start = time.perf_counter()
        window_tokens = 0
        while not done:
            batches = [next(run.data.train).to(run.device, non_blocking=True)
                       for _ in range(run.plan.grad_accum_steps)]
            lr = run.schedule.lr
            pending.append(self.train_step(batches))
            run.schedule.step()
            step += 1
            log.advance(1)
            result.tokens += run.plan.tokens_per_step
            window_tokens += run.plan.tokens_per_step
            elapsed = progress.elapsed + time.perf_counter() - start
            done = budget_spent(tcfg, step, result.tokens, elapsed)
            if step % tcfg.log_interval == 0 or done:
                losses, grad_norms = self._read(pending)
                pending.clear()
                result.losses += losses
                now = time.perf_counter()
                tps = window_tokens / (now - window_start)
                result.tokens_per_s.append(tps)
                log.advance(0, losses[-1])
                log.log({"step": step, "loss": losses[-1], "lr": lr, "grad_norm": grad_norms[-1],
                         "tokens_per_s": tps, "mfu": tps * flops_tok / peak,
                         "peak_mem_mb": peak_memory_mb(run.device), "tokens": result.tokens,
                         **run.data.train.window_stats(len(losses))})
                window_start, window_tokens = time.perf_counter(), 0
            if step % tcfg.eval_interval == 0 or done:
                self._evaluate(step, log, result)
                window_start = time.perf_counter()  # evaluation time is not training throughput
            run.checkpointer.maybe_save(Progress(step, result.tokens, elapsed), final=done)

        run.checkpointer.close()  # the last save, if it runs in the background, is waited for
        result.steps, result.peak_mem_mb = step, peak_memory_mb(run.device)
        run.data.train.close()
        result.tokens_by_source = run.data.train.tokens_by_source()
        log.log({"step": step, "tokens_by_source": result.tokens_by_source})
        log.close()
        self._save_weights()
        result.sample = self._sample()
        return result

    def _read(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[float]]:
        """The losses and grad norms of the steps since the last log line: one sync for all."""
        losses = torch.stack([loss for loss, _ in pending])
        if self.dp_group is not None:  # each rank holds its share of the global mean
            dist.all_reduce(losses, group=self.dp_group)
        return losses.tolist(), torch.stack([norm for _, norm in pending]).tolist()

    def _open_log(self, progress: Progress):
        run = self.run
        total = run.plan.total_steps
        if not run.is_main:
            return _Silent()
        if run.resumed is None:
            (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run; a resumed one appends
        log = MetricsLog(run.run_dir / "metrics.jsonl", total, self.cfg.metrics.progress_bar, progress.step)
        if run.resumed:
            log.log({"step": progress.step, "resumed_from": run.resumed.source,
                     "config_changes": run.resumed.changes})
        print(f"kiln: {count_parameters(self.cfg.model) / 1e6:.1f}M parameters, "
              f"{run.data.train_tokens:,} training tokens, {run.plan.tokens_per_step:,} tokens/step "
              f"({run.plan.global_batch_size} x {self.cfg.data.seq_len}, {run.plan.grad_accum_steps} "
              f"micro-batches/rank), layout {run.layout}, device {run.device}, run dir {run.run_dir}",
              flush=True)
        return log

    @torch.no_grad()
    def _evaluate(self, step: int, log, result: TrainResult) -> None:
        run = self.run
        val_sets = run.data.val_sets or {"val": run.data.val}
        record = {"step": step}
        self.model.eval()
        for i, (name, batches) in enumerate(val_sets.items()):
            loss_sum = torch.zeros((), device=run.device)
            count = 0
            for batch in batches:
                batch = batch.to(run.device)
                with run.amp:
                    loss_sum += run.task.loss_sum(self.model, batch)
                count += int(batch.count_targets())
            loss = loss_sum.item() / count
            if i == 0:  # the first set is the run's headline val_loss
                result.val_losses.append((step, loss))
                record.update(val_loss=loss, val_ppl=math.exp(min(loss, 50)))
            if len(val_sets) > 1:
                record.update({f"val/{name}_loss": loss, f"val/{name}_ppl": math.exp(min(loss, 50))})
        self.model.train()
        log.log(record)

    def _save_weights(self) -> None:
        # Every rank takes part in gathering the full weights; rank 0 writes them.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                          cpu_offload=True))
        if not self.run.is_main:
            return
        if self.cfg.model.tie_embeddings:
            state.pop("lm_head.weight", None)  # the embedding's; safetensors keeps one copy
        tmp = self.run.run_dir / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.run.run_dir / "model.safetensors")

    def _sample(self) -> str:
        run, tcfg = self.run, self.cfg.train
        if tcfg.sample_tokens == 0:
            return ""
        if hasattr(run.task, "sample"):  # the task knows what to generate from (held-out prompts)
            return run.task.sample(self.model, run)
        prompt = torch.tensor([run.data.tokenizer.encode(tcfg.sample_prompt).ids], device=run.device)
        self.model.eval()
        with run.amp:  # every rank samples the same (same seed): sharded forwards need them all
            out = self.model.generate(prompt, tcfg.sample_tokens,
                                      generator=torch.Generator(run.device).manual_seed(tcfg.seed))
        return run.data.tokenizer.decode(out[0].tolist())


def forward_backward(model: nn.Module, loss_sum, batches: list[Batch], amp=nullcontext(),
                     dp_group=None) -> torch.Tensor:
    """Forward and backward over a step's micro-batches; returns this rank's share of the mean
    loss (the sum over data-parallel ranks is the step's loss), on the device."""
    # Divide by the count of targets over all micro-batches and data-parallel ranks, so any
    # accumulation or layout gives the gradient of one big batch.
    n_targets = torch.stack([b.count_targets() for b in batches]).sum().float()
    # FSDP2 averages gradients over data-parallel ranks: scale by their number to sum them.
    ranks = 1
    if dp_group is not None:
        dist.all_reduce(n_targets, group=dp_group)
        ranks = dist.get_world_size(dp_group)
    total = torch.zeros((), device=batches[0].tokens.device)
    for batch in batches:
        with amp:
            loss = loss_sum(model, batch) / n_targets
        (loss * ranks if ranks > 1 else loss).backward()
        total += loss.detach()
    return total


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_sum, batches: list[Batch],
               amp=nullcontext(), grad_clip: float | None = None,
               dp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; (loss, grad norm) as device tensors: nothing here waits for the device."""
    loss = forward_backward(model, loss_sum, batches, amp, dp_group)
    grad_norm = clip_grad_norm([p for p in model.parameters() if p.grad is not None], grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The norm of all gradients together (over every shard), clipped to max_norm if given."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, torch.distributed.tensor.DTensor):  # sharded: the norm over all shards
        norm = norm.full_tensor()
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def budget_spent(tcfg, step: int, tokens: int, elapsed: float) -> bool:
    return bool((tcfg.max_steps and step >= tcfg.max_steps)
                or (tcfg.max_tokens and tokens >= tcfg.max_tokens)
                or (tcfg.max_time and elapsed >= tcfg.max_time))


class _Silent:
    """The metrics log of ranks other than 0: they compute the same figures and write nothing."""

    def log(self, record: dict) -> None:
        pass

    def advance(self, steps: int = 1, loss: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass
