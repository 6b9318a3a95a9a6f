"""Pipeline parallel: the blocks split into stages, run by a torch.distributed.pipelining schedule.

Each stage is the model built on the meta device with the parts it does not run deleted: the
layers of other stages (the ModuleDict keeps the rest under their own names, so checkpoints and
exports see the names of the whole model), the embedding unless it is the first stage, the final
norm and output projection unless it is the last. The stage is then parallelised, materialised
and initialised like a whole model (initialisation is seeded per parameter name, so any split
gives the same weights).

One optimizer step is one `schedule.step`: the rank's gradient-accumulation micro-batches are its
pipeline microbatches. The last stage returns hidden states and the loss runs the output
projection in chunks (kiln.train.loss), divided by the step's global count of targets, so the
schedule must not rescale gradients (scale_grads=False).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from kiln.config import JobConfig
from kiln.data.batch import IGNORE_INDEX, Batch
from kiln.errors import KilnError
from kiln.models.transformer import Transformer
from kiln.train.loss import chunked_cross_entropy


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: its index, the count, and the block indices it runs."""

    index: int
    count: int
    layers: tuple[int, ...]

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def cut(self, model: Transformer) -> Transformer:
        """Delete from a (meta) model what this stage does not run; the rest keeps its names."""
        keep = {str(i) for i in self.layers}
        for key in [k for k in model.layers if k not in keep]:
            del model.layers[key]
        if not self.is_first:
            model.embed = None
        if not self.is_last:
            model.norm = None
            model.lm_head = None
        return model


def stage_specs(n_layers: int, pp: int, pp_rank: int, stages_per_rank: int) -> list[StageSpec]:
    """This rank's stages. Blocks are split as evenly as possible, the earlier stages taking one
    more when they do not divide (the last stage also runs the output projection and the loss).
    Stages go round the ranks in a loop: rank r holds r, r + pp, ... (torch's V-shaped schedules,
    ZBVZeroBubble and DualPipeV, are not offered: in torch 2.13 their `eval` fails)."""
    count = pp * stages_per_rank
    base, extra = divmod(n_layers, count)
    bounds = [0]
    for s in range(count):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    indices = [pp_rank + k * pp for k in range(stages_per_rank)]
    return [StageSpec(i, count, tuple(range(bounds[i], bounds[i + 1]))) for i in indices]


class StagesView(Transformer):
    """The parameters of all of a rank's stages under the whole model's names (for the optimizer,
    checkpoints and exported weights) when a rank holds more than one stage. It shares the
    stages' modules; running it is the schedule's job, so it has no forward of its own."""

    def __init__(self, cfg, stages: list[Transformer]):
        with torch.device("meta"):
            super().__init__(cfg)
        layers = {k: v for m in stages for k, v in m.layers.items()}
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        self.embed = next((m.embed for m in stages if m.embed is not None), None)
        self.norm = next((m.norm for m in stages if m.norm is not None), None)
        self.lm_head = next((m.lm_head for m in stages if m.lm_head is not None), None)
        del self.inv_freq  # a meta buffer; each stage holds its own

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline rank's stages run through the pipeline schedule")

    def init_weights(self, seed: int = 0) -> None:
        raise RuntimeError("initialise each pipeline stage, not the view over them")


@dataclass
class Pipeline:
    """A rank's stages and the schedule that runs them; `step` is one optimizer step's forward
    and backward, `evaluate` a forward-only pass that sums the loss."""

    schedule: object
    stages: list[PipelineStage]
    models: list[Transformer]
    model: nn.Module
    """The model the trainer, optimizer and checkpointer see: the one stage, or a StagesView."""
    group: dist.ProcessGroup
    microbatches: int
    has_first: bool
    has_last: bool
    _divisor: torch.Tensor | None = field(default=None, repr=False)

    def loss_fn(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = next(m.lm_head for m in self.models if m.lm_head is not None)
        loss = chunked_cross_entropy(hidden, head, labels)
        return loss if self._divisor is None else loss / self._divisor

    def _inputs(self, batches: list[Batch]) -> tuple[tuple, dict]:
        for b in batches:
            if b.positions is not None or b.document_ids is not None:
                raise KilnError("parallel.pp > 1 with packed examples (per-token positions and "
                                "document ids): pipeline stages pass only hidden states between "
                                "them; use pp: 1 for this task")
        tokens = torch.cat([b.tokens for b in batches])
        labels = torch.cat([b.labels for b in batches])
        args = (tokens,) if self.has_first else ()
        return args, ({"target": labels} if self.has_last else {})

    def step(self, batches: list[Batch], dp_group=None, amp=nullcontext()) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; this rank's share of the mean loss
        (the sum over data-parallel and pipeline ranks is the step's loss)."""
        divisor = torch.stack([b.count_targets() for b in batches]).sum().float()
        if dp_group is not None:
            dist.all_reduce(divisor, group=dp_group)
        self._divisor = divisor
        args, kwargs = self._inputs(batches)
        losses: list[torch.Tensor] = []
        with amp:
            self.schedule.step(*args, losses=losses, **kwargs)
        self._divisor = None
        if not self.has_last:
            return torch.zeros((), device=batches[0].tokens.device)
        return torch.stack([loss.detach() for loss in losses]).sum()

    @torch.no_grad()
    def evaluate(self, batches: list[Batch], amp=nullcontext()) -> torch.Tensor:
        """The loss summed over `batches` (on the last stage; zero elsewhere). Batches go through
        in groups of `microbatches`, the shape the stages were set up with; a short last group
        is filled with copies whose targets are all ignored, which add nothing."""
        total = torch.zeros((), device=batches[0].tokens.device)
        for start in range(0, len(batches), self.microbatches):
            group = batches[start:start + self.microbatches]
            filler = Batch(group[0].tokens, torch.full_like(group[0].labels, IGNORE_INDEX))
            group = group + [filler] * (self.microbatches - len(group))
            args, kwargs = self._inputs(group)
            losses: list[torch.Tensor] = []
            with amp:
                self.schedule.eval(*args, losses=losses, **kwargs)
            if self.has_last:
                total += torch.stack(losses).sum()
        return total


def build_pipeline(cfg: JobConfig, mesh: DeviceMesh, device: torch.device, rank_batch: int,
                   grad_accum: int, build_stage: Callable[[StageSpec], Transformer]) -> Pipeline:
    """This rank's stages (each made by build_stage from a StageSpec) and the schedule.

    rank_batch: sequences per step on this data-parallel rank (micro_batch_size x grad_accum).
    """
    pcfg = cfg.parallel
    pp_mesh = mesh["pp"]
    microbatches = pcfg.pp_microbatches or grad_accum
    if rank_batch % microbatches:
        raise KilnError(f"parallel.pp_microbatches={microbatches} must divide the {rank_batch} "
                        "sequences each data-parallel rank takes per step (micro_batch_size x "
                        "gradient accumulation)")
    if any(stage.seq_len for stage in cfg.data.curriculum):
        raise KilnError("parallel.pp > 1 with a data.curriculum stage that changes seq_len: the "
                        "pipeline's stages are set up for one microbatch shape")
    specs = stage_specs(cfg.model.n_layers, pp_mesh.size(), pp_mesh.get_local_rank(),
                        pcfg.pp_stages_per_rank)
    models = [build_stage(spec) for spec in specs]
    last = next((m for m, s in zip(models, specs) if s.is_last), None)
    if last is not None:
        # The loss runs the output projection in chunks on the hidden states.
        last.register_forward_pre_hook(_return_hidden, with_kwargs=True)
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, s.index, s.count, device, group=group) for m, s in zip(models, specs)]
    cls = get_schedule_class(pcfg.pp_schedule)
    pipeline = Pipeline(None, stages, models, models[0] if len(models) == 1 else StagesView(cfg.model, models),
                        group, microbatches, any(s.is_first for s in specs), last is not None)
    multi = issubclass(cls, PipelineScheduleMulti)
    # The loss is already divided by the global count of targets: gradients must not be
    # divided again by the number of microbatches.
    pipeline.schedule = cls(stages if multi else stages[0], n_microbatches=microbatches,
                            loss_fn=pipeline.loss_fn, scale_grads=False)
    return pipeline


def _return_hidden(module, args, kwargs):
    return args, {**kwargs, "return_hidden": True}


def gather_stages(state: dict, mesh: DeviceMesh) -> dict:
    """The whole model's (full, CPU) state dict on global rank 0, from each stage's on the
    pipeline ranks that share rank 0's other coordinates; others get theirs back unchanged."""
    others = [mesh[d].get_local_rank() for d in mesh.mesh_dim_names if d != "pp"]
    if any(others):
        return state
    pp = mesh["pp"]
    parts = [None] * pp.size() if pp.get_local_rank() == 0 else None
    dist.gather_object(state, parts, group_dst=0, group=pp.get_group())
    if parts is None:
        return state
    return {k: v for part in parts for k, v in part.items()}
