"""Next-token cross-entropy, summed over the targets that count (labels != -100).

The task divides the sum by the global count of targets (over micro-batches and data-parallel
ranks), so accumulation and data parallelism give the update of one big batch.

The output projection runs inside the loss, in chunks of rows, so the full (tokens x vocab)
logits never exist at once: for a small model they are the largest activation by far.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from kiln.data.batch import IGNORE_INDEX
from kiln.models.moe import RoutingStats, load_balancing_loss, moe_layers, pool_routing, router_z_loss


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain formula, on whole logits (float32): the reference the chunked loss matches."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor,
                          chunk_elements: int = 2**22, targets_only: bool = False) -> torch.Tensor:
    """sum of cross_entropy(head(hidden), labels) in float32, holding at most about
    chunk_elements logits at a time.

    A plain nn.Linear head with a plain weight takes the fused path (each chunk's gradient is
    made in the forward pass, no recompute). Anything else (an adapter wrapping the head, a
    head sharded by tensor parallel) is called as a module on each chunk, with the chunk's
    logits recomputed in backward instead of kept.

    targets_only: the head runs on the rows that have a target only (one host sync to count
    them). For fine-tuning data, whose prompts are no targets, that skips most of the head's
    work; pretraining, where every row is a target, leaves it off.
    """
    if targets_only and not isinstance(hidden, DTensor):
        labels = labels.reshape(-1)
        rows = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        labels = labels.index_select(0, rows)
    if type(head) is nn.Linear and head.bias is None and not isinstance(head.weight, DTensor):
        return linear_cross_entropy(hidden, head.weight, labels, chunk_elements)
    vocab = head.out_features if hasattr(head, "out_features") else head.weight.shape[0]
    chunk_rows = max(64, chunk_elements // vocab)
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, h.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        total = total + checkpoint(_head_loss, head, h[rows], y[rows], use_reentrant=False)
    return total


def aux_losses(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary losses of the model's last training forward (one micro-batch), weighted:
    aux_loss_coef x the load-balancing loss + router_z_loss_coef x the router z-loss, as
    transformers adds them to a mixture of experts' loss. None without MoE layers or when the
    model is not training (validation reports the language-model loss alone).

    The task adds it to its loss sum multiplied by the micro-batch's target count: the trainer
    divides every micro-batch's sum by the step's global target count N, so micro-batch i
    contributes n_i / N x aux_i and the step's loss is the mean cross-entropy plus the
    target-weighted mean of the micro-batches' aux losses, which is their plain mean when the
    micro-batches hold equal targets (pretraining), and exactly transformers' loss for a step of
    one micro-batch. Each layer records its routing once per forward (not again when activation
    checkpointing recomputes it), so nothing is counted twice.
    """
    if not model.training:
        return None
    layers = [m for m in moe_layers(model).values() if m.stats is not None]
    if not layers:
        return None
    return _weighted(layers[0].cfg, [m.stats for m in layers])


def aux_loss_sum(model: nn.Module, n_targets: torch.Tensor) -> torch.Tensor | None:
    """What a micro-batch adds to its loss sum for the auxiliary losses: aux_losses(model) x
    n_targets in one process.

    Over data-parallel ranks (the MoE layers' balance_group), the step's i-th micro-batches of
    all ranks are balanced as one micro-batch, as one process running them together would: the
    token counts, rows and targets are summed over the ranks, and each rank adds its share
    (its own tokens' routing probabilities against the pooled counts) times the pooled targets.
    The shares add up over the ranks to the pooled micro-batch's aux loss times its targets, so
    a layout gives the losses and gradients of one process whose micro-batch holds the
    data-parallel ranks' micro-batches (data-parallel ranks take consecutive slices of each
    global micro-batch), and the load the loss balances is the experts' global load.
    """
    if not model.training:
        return None
    layers = [m for m in moe_layers(model).values() if m.stats is not None]
    if not layers:
        return None
    stats, group = [m.stats for m in layers], layers[0].balance_group
    if group is not None:
        stats, n_targets = pool_routing(stats, group, n_targets)
    return _weighted(layers[0].cfg, stats) * n_targets


def _weighted(cfg, stats: list[RoutingStats]) -> torch.Tensor:
    total = cfg.aux_loss_coef * load_balancing_loss(stats)
    if cfg.router_z_loss_coef:
        total = total + cfg.router_z_loss_coef * router_z_loss(stats)
    return total


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk_elements: int = 2**22) -> torch.Tensor:
    """cross_entropy_sum(hidden @ weight.T, labels), fused: no whole logits, no recompute."""
    chunk_rows = max(64, chunk_elements // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_rows, torch.is_grad_enabled())


def _head_loss(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(h).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


class _LinearCrossEntropy(torch.autograd.Function):
    """sum of cross_entropy(hidden @ weight.T, labels) over rows, in chunks of rows.

    Each chunk's logits become its gradient in place, in the forward pass; the gradients of
    hidden and weight are kept for backward, which only scales them. The weight's gradient is
    accumulated in the weight's own dtype (no extra float32 vocab x dim buffer).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_rows: int, grad_enabled: bool) -> torch.Tensor:
        device = hidden.device.type
        # Under autocast, compute the matmuls in the autocast dtype, as autograd's path would.
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else hidden.dtype)
        h, w = hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype)
        labels = labels.reshape(-1)
        # needs_input_grad says True under torch.no_grad too: evaluation must not pay for grads.
        want_h, want_w = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        needs_grad = want_h or want_w
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            for start in range(0, h.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                logp = torch.log_softmax((h[rows] @ w.T).float(), dim=-1)
                y = labels[rows]
                keep = y != IGNORE_INDEX
                y_safe = torch.where(keep, y, 0).unsqueeze(1)
                picked = logp.gather(1, y_safe).squeeze(1)
                loss -= torch.where(keep, picked, 0).sum()
                if not needs_grad:
                    continue
                grad = logp.exp_()  # softmax, in place of the log-probabilities
                grad.scatter_add_(1, y_safe, torch.full_like(y_safe, -1, dtype=grad.dtype))
                grad = grad.to(dtype)
                # Ignored rows get no gradient: mask the narrow (rows x dim) sides, not the logits.
                keep_col = keep.unsqueeze(1).to(dtype)
                if grad_h is not None:
                    torch.mm(grad, w, out=grad_h[rows]).mul_(keep_col)
                if grad_w is not None:
                    grad_w.add_(grad.T @ (h[rows] * keep_col))
        ctx.save_for_backward(grad_h, grad_w)
        ctx.shape, ctx.dtypes = hidden.shape, (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h * grad_loss.to(grad_h.dtype)).view(ctx.shape).to(ctx.dtypes[0])
        if grad_w is not None:
            grad_w = (grad_w * grad_loss).to(ctx.dtypes[1])
        return grad_h, grad_w, None, None, None
