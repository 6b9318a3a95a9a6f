"""Autograd functions for the transformer's memory-bound parts: the same formulas as the plain
PyTorch ops, in fewer passes over memory and with fewer saved tensors (eager mode on CPU or GPU).

Autograd's own backward of a decomposed RMSNorm or rotary embedding is a dozen small kernels,
each a full read and write of the activations; on a CPU these cost as much as the matmuls of a
small model. Each function here has a hand-written backward, checked against autograd in tests.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32
        # One read for the statistic (vector_norm), not a squared copy and then a mean.
        rstd = torch.rsqrt(torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
                           .div_(x.shape[-1]).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).mul_(weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad = grad.to(rstd.dtype)
        xhat = x.to(rstd.dtype) * rstd
        gx_hat = grad * xhat  # d loss / d weight, per row
        grad_weight = gx_hat.flatten(0, -2).sum(0).to(weight.dtype)
        # d x = rstd * (g w - xhat * mean(g w xhat)); mean(g w xhat) is one matrix-vector product.
        dot = (gx_hat @ weight.to(rstd.dtype)).unsqueeze(-1).div_(x.shape[-1])
        grad_x = (grad * weight).addcmul_(xhat, dot, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, statistics in float32 (as torch.nn.RMSNorm)."""
    return _RMSNorm.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2 of the last dimension."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():  # Inductor fuses this into one kernel; dynamo refuses out=
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        # A rotation's transpose is the rotation by the opposite angle.
        return _rotate(grad, cos, -sin), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (..., head_dim), pairs (i, i + head_dim/2) rotated together.

    cos and sin hold one half, (..., head_dim/2), broadcastable to x's leading dimensions; they
    are cast to x's dtype (as Hugging Face does), since mixed-dtype products are slow on CPUs.
    """
    return _Rope.apply(x, cos.to(x.dtype), sin.to(x.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """sum of cross_entropy(hidden @ weight.T, targets) over rows, in chunks of rows.

    The full logits (rows x vocab, the largest activation of a small model) never exist: each
    chunk's logits become its gradient in place, in the forward pass, and the gradients of
    hidden and weight are kept for backward, which only scales them.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                ignore_index: int, chunk_rows: int, grad_enabled: bool) -> torch.Tensor:
        device = hidden.device.type
        # Under autocast, compute the matmuls in the autocast dtype, as autograd's path would.
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else hidden.dtype)
        h, w = hidden.reshape(-1, hidden.shape[-1]).to(dtype), weight.to(dtype)
        targets = targets.reshape(-1)
        # needs_input_grad says True under torch.no_grad too: evaluation must not pay for grads.
        want_h, want_w = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        needs_grad = want_h or want_w
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if want_w else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device, enabled=False):
            for start in range(0, h.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                logp = torch.log_softmax((h[rows] @ w.T).float(), dim=-1)
                y = targets[rows]
                keep = y != ignore_index
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
        return grad_h, grad_w, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_elements: int = 2**22) -> torch.Tensor:
    """Summed next-token cross-entropy of the logits hidden @ weight.T, in float32.

    The same value and gradients as F.cross_entropy(F.linear(hidden, weight).float(), targets,
    ignore_index=ignore_index, reduction="sum"), holding at most chunk_elements logits at once.
    """
    chunk_rows = max(64, chunk_elements // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, chunk_rows,
                                     torch.is_grad_enabled())
