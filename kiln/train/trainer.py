"""The training loop: Trainer.fit runs optimizer steps over the parts kiln.train.build made."""

from __future__ import annotations

import math
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from kiln.checkpoint.checkpointer import Progress, without_frozen
from kiln.config import JobConfig
from kiln.data.batch import Batch
from kiln.models.transformer import count_parameters, flops_per_token
from kiln.parallel.health import rank_health
from kiln.parallel.mesh import dp_group, rank_world
from kiln.eval.tasks import run_tasks
from kiln.parallel.pipeline import gather_stages
from kiln.errors import KilnError, Preempted
from kiln.tracking import Trackers
from kiln.train.guards import Action, HangWatchdog, PreemptionFlag, StepGuard
from kiln.train.build import Run, build
from kiln.train.metrics import MetricsLog, moe_metrics, peak_memory_mb, resolve_peak


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
    made = cfg.run_dir  # the outermost directory this run will create, if any
    while not made.parent.exists() and made.parent != made:
        made = made.parent
    fresh, trainer = not made.exists(), None
    try:
        trainer = Trainer(build(cfg, resume))
        return trainer.fit()
    except KilnError as e:
        if isinstance(e, Preempted):
            raise
        # A run refused before its first step leaves behind no run directory it made itself.
        if fresh and (trainer is None or trainer.step == 0) and rank_world()[0] == 0:
            shutil.rmtree(made, ignore_errors=True)
        raise


class Trainer:
    def __init__(self, run: Run):
        self.run = run
        self.cfg, self.model, self.optimizer = run.cfg, run.model, run.optimizer
        self.dp_group = dp_group(run.mesh)
        # guards.skip_bad_steps: each step's loss and gradient norm are checked before the update.
        self.guard = StepGuard.from_config(self.cfg.guards) if self.cfg.guards.skip_bad_steps else None
        if self.guard is not None and run.resumed is not None and run.resumed.guard is not None:
            self.guard.load_state_dict(run.resumed.guard)  # a restart keeps counting bad steps
        run.checkpointer.guard = self.guard  # saved with every checkpoint
        self.action, self.step = Action.APPLY, 0
        self.pp_group = run.pipeline.group if run.pipeline is not None else None

    # -- one step ------------------------------------------------------------------------------

    def forward_backward(self, batches: list[Batch]) -> torch.Tensor:
        """This rank's share of the step's mean loss, on the device; the seam a pipeline
        schedule replaces."""
        if self.run.pipeline is not None:  # the schedule runs every stage's part of it
            return self.run.pipeline.step(batches, self.dp_group, self.run.amp)
        return forward_backward(self.model, self.run.task.loss_sum, batches, self.run.amp, self.dp_group)

    def train_step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.guard is not None:
            return self._guarded_step(batches)
        if self.run.pipeline is None:
            return train_step(self.model, self.optimizer, self.run.task.loss_sum, batches,
                              self.run.amp, self.cfg.optim.grad_clip, self.dp_group, self.run.scaler)
        # Pipeline stages (no fp16 gradient scaler there: refused at build).
        loss = self.forward_backward(batches)
        grad_norm = clip_grad_norm([p for p in self.model.parameters() if p.grad is not None],
                                   self.cfg.optim.grad_clip, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _guarded_step(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step, with its global loss and gradient norm read before the update: a
        non-finite value or a spike skips the update (guards.skip_bad_steps)."""
        loss = self.forward_backward(batches)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.run.scaler is not None:
            self.run.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(params, self.cfg.optim.grad_clip, self.pp_group)
        total = loss.detach().clone()
        for group in (self.dp_group, self.pp_group):
            if group is not None:
                dist.all_reduce(total, group=group)
        self.action = self.guard.check(self.step + 1, total.item(), grad_norm.item(),
                                       self.run.data.train.state_dict())
        if self.action == Action.APPLY:
            if self.run.scaler is not None:
                self.run.scaler.step(self.optimizer)
                self.run.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _stop_requested(self, flag: PreemptionFlag) -> bool:
        """All ranks agree at this step boundary: one CPU all-reduce on the checkpointer's gloo
        group, so a GPU is never waited for."""
        group = self.run.checkpointer.group
        if group is None:
            return flag.requested
        t = torch.tensor([int(flag.requested)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t.item())

    def _rollback(self, log) -> Progress | None:
        """Back to the newest committed checkpoint after a streak of bad steps; the replay
        reads the batches that caused them but does not train on them."""
        ckpt = self.run.checkpointer
        ckpt.wait()
        resumed = ckpt.restore("auto")
        if resumed is None:
            return None
        # The guard keeps its own state, not the checkpoint's: that one predates the bad steps
        # this rollback is about (their count and the batches to skip).
        skipped = self.guard.rolled_back(resumed.progress.step)
        log.log({"step": self.step, "rolled_back_to": resumed.progress.step,
                 "skipping_steps": sorted(skipped)})
        return resumed.progress

    # -- the loop ------------------------------------------------------------------------------

    def fit(self) -> TrainResult:
        run, cfg, tcfg = self.run, self.cfg, self.cfg.train
        progress = run.resumed.progress if run.resumed else Progress()
        log = self._open_log(progress)
        flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
        peak = resolve_peak(run.device, run.precision.matmul_dtype, cfg.metrics.peak_tflops)
        if run.is_main:
            print(f"kiln: MFU peak per rank {peak.flops / 1e12:.3g} TFLOP/s ({peak.source})", flush=True)
            log.log({"step": progress.step, "precision": run.precision_record})
        peak = peak.flops * run.layout.world_size
        result = TrainResult(start_step=progress.step, tokens=progress.tokens)
        step = progress.step
        done = budget_spent(tcfg, step, result.tokens, progress.elapsed)
        if run.resumed is None or done:
            self._evaluate(step, log, result)
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # read at the next log line
        start = window_start = time.perf_counter()
        window_tokens = 0
        busy = 0.0  # this rank's own seconds in the window's steps (per-rank health)
        flag = PreemptionFlag.from_config(cfg.guards)
        watchdog = HangWatchdog.from_config(cfg.guards)
        if threading.current_thread() is threading.main_thread():  # signals need the main thread
            flag.install()
            watchdog.start()
        try:
            while not done:
                step_start = time.perf_counter()
                self.step = step
                batches = [next(run.data.train).to(run.device, non_blocking=True)
                           for _ in range(run.plan.grad_accum_steps)]
                lr = run.schedule.lr
                if self.guard is not None and self.guard.skip_batch(step + 1):
                    self.action = Action.SKIP  # a batch that caused a rollback: read, not trained on
                else:
                    pending.append(self.train_step(batches))
                if self.action == Action.ROLLBACK and (restored := self._rollback(log)):
                    step, result.tokens = restored.step, restored.tokens
                    pending.clear()
                    continue
                self.action = Action.APPLY
                busy += time.perf_counter() - step_start
                watchdog.beat()
                run.schedule.step()
                step += 1
                log.advance(1)
                result.tokens += run.plan.tokens_per_step
                window_tokens += run.plan.tokens_per_step
                elapsed = progress.elapsed + time.perf_counter() - start
                done = budget_spent(tcfg, step, result.tokens, elapsed)
                if (step % tcfg.log_interval == 0 or done) and pending:
                    steps_in_window = len(pending)
                    losses, grad_norms = self._read(pending)
                    pending.clear()
                    result.losses += losses
                    now = time.perf_counter()
                    tps = window_tokens / (now - window_start)
                    result.tokens_per_s.append(tps)
                    log.advance(0, losses[-1])
                    mem = peak_memory_mb(run.device)
                    log.log({"step": step, "loss": losses[-1], "lr": lr, "grad_norm": grad_norms[-1],
                             "tokens_per_s": tps, "mfu": tps * flops_tok / peak,
                             "peak_mem_mb": mem, "tokens": result.tokens,
                             # each bad step once, also when a rollback replays past it
                             **({"bad_steps": len(self.guard.bad_steps)} if self.guard is not None else {}),
                             **run.data.train.window_stats(steps_in_window),
                             **moe_metrics(self.model, self.dp_group),
                             **rank_health(busy / steps_in_window, mem, run.device)})
                    window_start, window_tokens, busy = time.perf_counter(), 0, 0.0
                with watchdog.paused():
                    if step % tcfg.eval_interval == 0 or done:
                        self._evaluate(step, log, result)
                        window_start = time.perf_counter()  # evaluation is not training throughput
                    preempted = self._stop_requested(flag)
                    run.checkpointer.maybe_save(Progress(step, result.tokens, elapsed),
                                                final=done or preempted)
                if preempted:
                    run.checkpointer.close()  # committed before the process goes
                    log.log({"step": step, "preempted": flag.signal_name or "flag"})
                    log.close()
                    raise Preempted(f"{flag.signal_name or 'a stop request'}: checkpoint of step "
                                    f"{step} committed; the run resumes from it (--resume auto)")
        finally:
            watchdog.stop()
            flag.uninstall()

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
        for group in (self.dp_group, self.pp_group):  # each rank holds its share of the mean
            if group is not None:
                dist.all_reduce(losses, group=group)
        return losses.tolist(), torch.stack([norm for _, norm in pending]).tolist()

    def _open_log(self, progress: Progress):
        run = self.run
        total = run.plan.total_steps
        if not run.is_main:
            return _Silent()
        if run.resumed is None:
            (run.run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a fresh run; a resumed one appends
        log = MetricsLog(run.run_dir / "metrics.jsonl", total, self.cfg.metrics.progress_bar, progress.step)
        # metrics.jsonl and the console, then TensorBoard / MLflow as cfg.tracking says.
        log = Trackers.open(self.cfg, run.run_dir, run.rank, progress.step,
                            run.resumed.source if run.resumed else None, run.layout.world_size, log)
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
            batches = [batch.to(run.device) for batch in batches]
            count = sum(int(batch.count_targets()) for batch in batches)
            if run.pipeline is not None:  # the sum is on the last stage: add the stages up
                loss_sum = run.pipeline.evaluate(batches, run.amp)
                dist.all_reduce(loss_sum, group=self.pp_group)
            else:
                loss_sum = torch.zeros((), device=run.device)
                for batch in batches:
                    with run.amp:
                        loss_sum += run.task.loss_sum(self.model, batch)
            loss = loss_sum.item() / count
            if i == 0:  # the first set is the run's headline val_loss
                result.val_losses.append((step, loss))
                record.update(val_loss=loss, val_ppl=math.exp(min(loss, 50)))
            if len(val_sets) > 1:
                record.update({f"val/{name}_loss": loss, f"val/{name}_ppl": math.exp(min(loss, 50))})
        if self.cfg.tracking.eval_tasks:  # every rank takes part in the forwards
            record.update(run_tasks(self.model, run.data.info, self.cfg.tracking.eval_tasks))
        self.model.train()
        if run.is_main:
            run.checkpointer.best.observe(record)
        log.log(record)

    def _save_weights(self) -> None:
        # Every rank takes part in gathering the full weights; rank 0 writes them. Frozen
        # weights (an adapter run's base) are left out: the run never copies its base.
        # With cpu_offload only global rank 0 receives the tensors; pipeline stages other than
        # rank 0's must receive theirs to hand them on, so they gather on the device.
        stages = self.pp_group is not None
        state = get_model_state_dict(self.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=not stages, ignore_frozen_params=True))
        state = without_frozen(self.model, state)
        if stages:  # each stage has its own layers: rank 0 gathers them
            state = gather_stages({k: v.cpu() for k, v in state.items()}, self.run.mesh)
        if not self.run.is_main:
            return
        if self.cfg.model.tie_embeddings:
            state.pop("lm_head.weight", None)  # the embedding's; safetensors keeps one copy
        tmp = self.run.run_dir / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(self.run.run_dir / "model.safetensors")

    def _sample(self) -> str:
        run, tcfg = self.run, self.cfg.train
        if tcfg.sample_tokens == 0 or run.pipeline is not None:  # no sampling through stages
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
                     dp_group=None, scaler=None) -> torch.Tensor:
    """Forward and backward over a step's micro-batches; returns this rank's share of the mean
    loss (the sum over data-parallel ranks is the step's loss), on the device."""
    # Divide by the count of targets over all micro-batches and data-parallel ranks, so any
    # accumulation or layout gives the gradient of one big batch.
    n_targets = torch.stack([b.count_targets() for b in batches]).sum().float()
    # FSDP2 sums (not averages) gradients over data-parallel ranks: kiln.parallel.parallelize.
    if dp_group is not None:
        dist.all_reduce(n_targets, group=dp_group)
    total = torch.zeros((), device=batches[0].tokens.device)
    for batch in batches:
        with amp:
            loss = loss_sum(model, batch) / n_targets
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach()
    return total


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_sum, batches: list[Batch],
               amp=nullcontext(), grad_clip: float | None = None,
               dp_group=None, scaler=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; (loss, grad norm) as device tensors: nothing here waits for the device
    (except fp16's gradient scaler, which must look for infinities)."""
    loss = forward_backward(model, loss_sum, batches, amp, dp_group, scaler)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm([p for p in model.parameters() if p.grad is not None], grad_clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None,
                   pp_group=None) -> torch.Tensor:
    """The 2-norm of all gradients together, over every shard and pipeline stage, and the
    gradients clipped to max_norm if given.

    Gradients are grouped by the mesh they live on (tensor-parallel blocks on (dp, tp), the
    embedding and head on dp alone, or plain tensors): foreach kernels take one kind at a
    time. A DTensor group's norm is over all its shards; pp_group adds the other stages'.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):  # sharded: the norm over all shards
            norm = norm.full_tensor()
        norms.append(norm)
    if not norms:
        return torch.zeros(())
    total = norms[0]
    if len(norms) > 1 or pp_group is not None:
        squares = torch.stack([n.float().square() for n in norms]).sum()
        if pp_group is not None:  # each stage holds its own layers' gradients
            dist.all_reduce(squares, group=pp_group)
        total = squares.sqrt()
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


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
