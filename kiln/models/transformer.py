"""A decoder-only transformer covering Llama 2/3/3.x, Mistral and Qwen2/2.5/3 by its arguments.

Token embedding -> N x [RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output projection. Qwen2 adds a bias to
q/k/v; Qwen3 normalises each query and key head; Llama 3 rescales the RoPE frequencies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig, RopeScaling
from kiln.models.fused import linear_cross_entropy, rms_norm, rope


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with Llama 3's long-context scaling if given."""
    # float32 throughout, as the reference implementations compute it.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(between, interpolated, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles: (seq, 1, head_dim/2), for (batch, seq, heads, -)."""
    positions = torch.arange(seq_len, dtype=torch.float32, device=inv_freq.device)
    angles = torch.outer(positions, inv_freq).unsqueeze(1)
    return angles.cos(), angles.sin()


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm (same parameter, same result) with a backward in fewer memory passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_size
        self.q = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, kv = self.n_heads, self.n_kv_heads
        # One matmul for q, k and v (and one in backward for their input gradient): wider
        # matmuls run faster, and the parameters stay the three named as in Hugging Face.
        qkv = F.linear(x, torch.cat([self.q.weight, self.k.weight, self.v.weight]),
                       None if self.q.bias is None else
                       torch.cat([self.q.bias, self.k.bias, self.v.bias]))
        qkv = qkv.view(b, t, h + 2 * kv, self.head_dim)
        if self.q_norm is None:
            qk, v = qkv.split([h + kv, kv], dim=2)
            q, k = rope(qk, cos, sin).split([h, kv], dim=2)  # q and k rotated together
        else:
            q, k, v = qkv.split([h, kv, kv], dim=2)
            q, k = rope(self.q_norm(q), cos, sin), rope(self.k_norm(k), cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        # SDPA picks flash/cuDNN/memory-efficient kernels on GPUs and a fused kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, torch.cat([self.gate.weight, self.up.weight])).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        inv_freq = rope_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (batch, seq) int64 -> logits (batch, seq, vocab); or, given targets (batch,
        seq), the float32 cross-entropy summed over targets that are not -100.

        With targets, the logits are never materialised whole (see fused.linear_cross_entropy):
        the loss costs a fraction of their memory.
        """
        cos, sin = rope_cos_sin(self.inv_freq, tokens.shape[1])
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        if targets is None:
            return self.lm_head(self.norm(x))
        return linear_cross_entropy(self.norm(x), self.lm_head.weight, targets)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) everywhere; output projections of each block scaled by depth."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim == 1:  # norm weights, biases
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("o.weight", "down.weight")) else 1
                p.normal_(0.0, std * scale, generator=generator)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, n_new: int, temperature: float = 0.8,
                 top_k: int = 50, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample n_new tokens after `tokens` (1, t); a short demo, so no KV cache."""
        for _ in range(n_new):
            window = tokens[:, -self.cfg.max_seq_len:]
            logits = self(window)[:, -1, :].float() / temperature
            top = torch.topk(logits, min(top_k, logits.shape[-1]))
            logits[logits < top.values[:, -1:]] = -float("inf")
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens


def count_parameters(cfg: ModelConfig, embedding: bool = True) -> int:
    """Parameter count of the model `cfg` describes, computed from its shape alone."""
    d, h, kv, hd = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    attn += (h * hd + 2 * kv * hd) if cfg.qkv_bias else 0
    attn += 2 * hd if cfg.qk_norm else 0
    block = attn + 3 * d * cfg.intermediate_size + 2 * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    total = cfg.n_layers * block + d + head + (cfg.vocab_size * d if embedding else 0)
    return total


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul weights + attention scores.

    Matmul weights are the linear layers' (the output projection counts even when tied; the
    embedding lookup does not); attention adds 12 * layers * heads * head_dim * seq_len (PaLM).
    """
    d, h, kv, hd = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    per_layer = 2 * d * h * hd + 2 * d * kv * hd + 3 * d * cfg.intermediate_size
    matmul_weights = cfg.n_layers * per_layer + cfg.vocab_size * d
    return 6 * matmul_weights + 12 * cfg.n_layers * h * hd * seq_len
