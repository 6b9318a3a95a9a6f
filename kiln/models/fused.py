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
        # d x = rstd * (g w - xhat * mean(g w xhat)); mean(g w xhat) is one matrix-vector product.
        if torch.compiler.is_compiling():
            # Inductor fuses these; the views of the eager path cannot be traced through a
            # sequence split by tensor parallel (DTensor) with a dynamic batch size.
            grad_weight = gx_hat.sum(tuple(range(gx_hat.ndim - 1))).to(weight.dtype)
            dot = (gx_hat * weight.to(rstd.dtype)).sum(-1, keepdim=True).div_(x.shape[-1])
        else:
            grad_weight = gx_hat.flatten(0, -2).sum(0).to(weight.dtype)
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
