"""Mixture of experts: a top-k token-choice router over SwiGLU experts, dropless.

Each token goes to the top_k experts the router scores highest (softmax gating as Mixtral and
Qwen3-MoE, sigmoid gating as DeepSeek-V3); the experts' outputs are summed with the gate
weights. The routed experts' weights are stacked (experts x out x in), so expert parallelism can
shard dimension 0, and a device with grouped GEMMs runs all experts in one kernel per matrix.

Load balance: each layer keeps what the auxiliary losses need from its last training forward
(RoutingStats; kiln.train.loss.aux_losses turns them into losses) and counts the tokens each
expert received, for the metrics and for DeepSeek's auxiliary-loss-free bias update.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig


def is_moe(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` has a mixture of experts (else a dense MLP)."""
    return cfg.moe is not None and layer >= cfg.moe.first_k_dense


def expert_size(cfg: ModelConfig) -> int:
    return cfg.moe.intermediate_size or cfg.intermediate_size


def ffn_parameters(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Weights of layer `layer`'s MLP or MoE; active: only those one token goes through (the
    router, its top_k experts and the shared ones)."""
    d = cfg.dim
    if not is_moe(cfg, layer):
        return 3 * d * cfg.intermediate_size
    m = cfg.moe
    experts = (m.top_k if active else m.n_experts) + m.n_shared_experts
    return d * m.n_experts + experts * 3 * d * expert_size(cfg)


@dataclass
class RoutingStats:
    """What the auxiliary losses need from one MoE layer's last training forward."""

    counts: torch.Tensor
    """(experts,) float32: tokens routed to each expert (no gradient)."""
    prob_sum: torch.Tensor
    """(experts,) float32: each expert's routing probability summed over the tokens."""
    z_sum: torch.Tensor
    """() float32: logsumexp(router logits)^2 summed over the tokens (ST-MoE's z-loss)."""
    rows: int | torch.Tensor
    """Tokens routed."""


class SharedExperts(nn.Module):
    """The experts every token goes through, as one SwiGLU (DeepSeek's shared experts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Experts(nn.Module):
    """n SwiGLU experts with stacked weights: gate and up (n, hidden, dim), down (n, dim, hidden).

    forward takes the tokens sorted by expert and the count each expert gets. `compute`:
    'grouped' runs torch._grouped_mm (one kernel per matrix for all experts, no host sync);
    'loop' one matmul per expert (reads the counts on the host); 'auto' the grouped one where
    this device and dtype run it, else the loop. Both give the same result.
    """

    def __init__(self, n: int, dim: int, hidden: int, init_std: float = 0.02):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n, hidden, dim))
        self.up = nn.Parameter(torch.empty(n, hidden, dim))
        self.down = nn.Parameter(torch.empty(n, dim, hidden))
        self.compute = "auto"
        for p in (self.gate, self.up, self.down):
            nn.init.normal_(p, std=init_std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.swiglu(x, counts, self.gate, self.up, self.down)

    def swiglu(self, x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
        """The experts whose weights are given (all of them, or an expert-parallel block) on
        the rows sorted by expert, counts[e] rows for expert e."""
        device = x.device.type
        # Under autocast, compute in the autocast dtype, as nn.Linear would.
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x = x.to(dtype)
        gate, up, down = (w.to(dtype) for w in (gate, up, down))
        if self._grouped(x, dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, gate.mT, offs=offsets)) * torch._grouped_mm(
                x, up.mT, offs=offsets)
            return torch._grouped_mm(h, down.mT, offs=offsets)
        out = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            if rows.shape[0]:
                out.append(F.linear(F.silu(F.linear(rows, gate[e])) * F.linear(rows, up[e]), down[e]))
        if not out:  # no rows here (an expert-parallel rank can get none): still a gradient
            # for the weights (zeros), so every rank reduces the same gradients
            rows = x[:0]
            out.append(F.linear(F.silu(F.linear(rows, gate[0])) * F.linear(rows, up[0]), down[0]))
        return torch.cat(out)

    def _grouped(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        if self.compute != "auto":
            return self.compute == "grouped"
        # Grouped GEMMs need each row's stride to be a multiple of 16 bytes; torch.compile's
        # shape function for them (torch 2.13) accepts bf16 only, where eager takes fp32 too.
        aligned = all(n * x.element_size() % 16 == 0 for n in self.down.shape[1:])
        compilable = dtype == torch.bfloat16 or not torch.compiler.is_compiling()
        return aligned and compilable and grouped_mm_works(x.device.type, dtype)


@torch.compiler.disable  # a check run once, eagerly, not part of a compiled graph
@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here, right (checked once).

    It exists from torch 2.8 and CUDA runs it on sm90+ in bf16; torch 2.13's CPU build runs it
    in fp32 and bf16; other builds and devices may raise. A small case checked against plain
    matmuls is surer than a table of versions.
    """
    if not hasattr(torch, "_grouped_mm") or device_type == "meta":
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 16, generator=gen).to(device_type, dtype).requires_grad_()
    w = torch.randn(3, 16, 16, generator=gen).to(device_type, dtype).requires_grad_()
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32, device=device_type)
    try:
        # Identity saved-tensor hooks: when the first check runs inside an activation-
        # checkpointed forward, the checkpoint's own hooks must not take this small graph's
        # tensors (its recompute would then run the wrong function).
        with torch.autocast(device_type, enabled=False), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = torch._grouped_mm(x, w.mT, offs=offsets)
            grads = torch.autograd.grad(y.float().square().sum(), (x, w))
            ref = torch.cat([x[:5] @ w[0].T, x[5:] @ w[2].T])
            ref_grads = torch.autograd.grad(ref.float().square().sum(), (x, w))
    except (RuntimeError, NotImplementedError):
        return False
    tol = dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-4, rtol=1e-4)
    return all(torch.allclose(a.float(), b.float(), **tol) for a, b in zip((y, *grads), (ref, *ref_grads)))


def _in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing recomputes the forward
    there, and a recomputed forward must not count its tokens twice. (torch.utils.checkpoint
    asks the same question the same way.)"""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """router -> top-k experts per token -> gate-weighted sum of their outputs (+ shared experts)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m = cfg.moe
        self.cfg = m
        self.router = nn.Linear(cfg.dim, m.n_experts, bias=False)
        self.experts = Experts(m.n_experts, cfg.dim, expert_size(cfg), cfg.init_std)
        self.shared = (SharedExperts(cfg.dim, m.n_shared_experts * expert_size(cfg))
                       if m.n_shared_experts else None)
        # Added to the scores only to pick experts (DeepSeek-V3); saved with checkpoints.
        if m.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(m.n_experts))
        else:
            self.expert_bias = None
        # Tokens per expert since the metrics last read them / since the last bias update
        # (integers: exact however long, and left alone by a cast of the model's dtype).
        self.register_buffer("load_window", torch.zeros(m.n_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("load_step", torch.zeros(m.n_experts, dtype=torch.int64), persistent=False)
        self.stats: RoutingStats | None = None
        # The data-parallel ranks whose micro-batches are balanced together (set by
        # kiln.parallel.parallelize); None: this process's micro-batch alone.
        self.balance_group: dist.ProcessGroup | None = None

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero biases and counts (after materialising from the meta device)."""
        for buf in (self.expert_bias, self.load_window, self.load_step):
            if buf is not None:
                buf.zero_()

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (tokens, experts), chosen experts (tokens, k), their gate weights (tokens, k))."""
        scores = logits.softmax(-1) if self.cfg.gating == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        experts = choice.topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = self.router(h).float()
        scores, experts, weights = self.route(logits)
        out, counts = self._dispatch(h, experts, weights)
        if self.shared is not None:
            out = out + self.shared(h)
        if self.training and torch.is_grad_enabled():
            # The same ops when activation checkpointing recomputes this forward (it checks that
            # the same tensors are saved), but only the first forward keeps and counts them.
            stats = self._stats(logits, scores, counts)
            if not _in_backward():
                self.stats = stats
                with torch.no_grad():
                    self.load_window += counts
                    self.load_step += counts
        return out.view(shape)

    def _dispatch(self, h: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (token, expert) pair through its expert, dropless; (output, tokens per expert)."""
        flat = experts.flatten()
        # scatter_add, not bincount: no host sync on the way to the grouped GEMMs.
        counts = torch.zeros(self.cfg.n_experts, dtype=torch.int64, device=h.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        order = flat.argsort(stable=True)
        token = order // self.cfg.top_k
        y = self.experts(h[token], counts) * weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(h).index_add_(0, token, y.to(h.dtype)), counts

    def _stats(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> RoutingStats:
        # Probabilities for the balance loss: the softmax itself, or the sigmoid scores
        # normalised per token (DeepSeek-V3's complementary balance loss).
        probs = scores if self.cfg.gating == "softmax" else scores / scores.sum(-1, keepdim=True)
        return RoutingStats(counts.float(), probs.sum(0),
                            torch.logsumexp(logits, -1).square().sum(), logits.shape[0])


def moe_layers(model: nn.Module) -> dict[str, MoE]:
    """The model's MoE modules by name (layers.3.mlp, ...)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def pool_routing(stats: list[RoutingStats], group: dist.ProcessGroup, extra: torch.Tensor,
                 everything: bool = False) -> tuple[list[RoutingStats], torch.Tensor]:
    """The routing of the micro-batch on every rank of `group` together, in one all-reduce:
    token counts and rows summed over the ranks (they carry no gradient), and `extra` summed
    too. The probability and z-loss sums are summed as well when `everything` (for metrics);
    otherwise they stay this rank's own, so a loss made from the stats is this rank's share of
    the pooled micro-batch's loss (the shares add up to it over the ranks) with the gradient of
    this rank's tokens; summed over ranks, the gradients are the pooled loss's."""
    layers = len(stats)
    parts = [torch.stack([s.counts for s in stats]),
             torch.tensor([[float(s.rows)] for s in stats], device=stats[0].counts.device)]
    if everything:
        parts += [torch.stack([s.prob_sum for s in stats]).detach(),
                  torch.stack([s.z_sum for s in stats]).detach().unsqueeze(1)]
    flat = torch.cat([p.double().flatten() for p in parts] + [extra.double().reshape(1)])
    dist.all_reduce(flat, group=group)
    n = stats[0].counts.numel()
    counts = flat[:layers * n].view(layers, n).float()
    rows = flat[layers * n:layers * (n + 1)].float()
    probs = (flat[layers * (n + 1):layers * (2 * n + 1)].view(layers, n).float() if everything
             else [s.prob_sum for s in stats])
    zs = flat[layers * (2 * n + 1):layers * (2 * n + 2)].float() if everything else [s.z_sum for s in stats]
    pooled = [RoutingStats(counts[i], probs[i], zs[i], rows[i]) for i in range(layers)]
    return pooled, flat[-1].to(extra.dtype)


def load_balancing_loss(stats: list[RoutingStats]) -> torch.Tensor:
    """Switch Transformer's balance loss over the given layers, exactly as transformers'
    load_balancing_loss_func: n_experts * sum_e f_e * P_e, where f_e is the share of top-k
    assignments and P_e the mean routing probability of expert e, both pooled over all layers
    and tokens (not a per-layer mean). 1 x top_k when perfectly balanced."""
    rows = sum(s.rows for s in stats)
    f = torch.stack([s.counts for s in stats]).sum(0) / rows
    p = torch.stack([s.prob_sum for s in stats]).sum(0) / rows
    return f.numel() * (f * p).sum()


def router_z_loss(stats: list[RoutingStats]) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over all layers' tokens of logsumexp(router logits)^2."""
    return torch.stack([s.z_sum for s in stats]).sum() / sum(s.rows for s in stats)


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each expert's bias
    moves by bias_update_rate toward the mean load (the counts of this step's micro-batches,
    summed over `group`, the data-parallel ranks, so every rank moves its biases alike)."""
    layers = [m for m in moe_layers(model).values() if m.expert_bias is not None]
    if not layers:
        return
    loads = torch.stack([m.load_step for m in layers])
    if group is not None:
        dist.all_reduce(loads, group=group)
    loads = loads.float()
    for m, load in zip(layers, loads):
        m.expert_bias += m.cfg.bias_update_rate * torch.sign(load.mean() - load)
        m.load_step.zero_()
