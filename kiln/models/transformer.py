"""A decoder-only transformer covering Llama 2/3/3.x, Mistral and Qwen2/2.5/3 (and, with
model.moe, Mixtral and Qwen3-MoE) by its arguments.

Token embedding -> N x [RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP (or mixture of experts, kiln.models.moe) -> residual] -> RMSNorm ->
output projection. Qwen2 adds a bias to q/k/v; Qwen3 normalises each query and key head;
Llama 3 rescales the RoPE frequencies.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import ModelConfig, RopeScaling
from kiln.models.fused import rms_norm, rope
from kiln.models.moe import MoE, ffn_parameters, is_moe
from kiln.parallel.dtensor import copy_full_into


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


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int,
                 positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, for q/k laid out (batch, seq, heads, head_dim).

    Without positions: (seq, 1, head_dim/2), positions 0..seq-1. With positions (batch, seq),
    e.g. restarting at 0 for each example packed into a sequence: (batch, seq, 1, head_dim/2).
    """
    if positions is None:
        positions = torch.arange(seq_len, device=inv_freq.device)
    angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(-2)
    return angles.cos(), angles.sin()


def document_mask(document_ids: torch.Tensor | None) -> torch.Tensor | None:
    """Causal attention within each document: (batch, 1, seq, seq) booleans, True = attend.

    None (plain causal attention) when there are no document ids. Several examples packed into
    one sequence must not see each other; SDPA takes the mask on every device.
    """
    if document_ids is None:
        return None
    t = document_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    return (same & causal).unsqueeze(1)


class RMSNorm(nn.RMSNorm):
    """torch.nn.RMSNorm (same parameter, same result) with a backward in fewer memory passes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; q, k, v and o are called as modules, so tensor
    parallel plans and adapters that replace them take effect."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_size
        self.q = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads, not n_heads: tensor parallel leaves each rank a slice of the heads.
        q = self.q(x).view(b, t, -1, self.head_dim)
        k = self.k(x).view(b, t, -1, self.head_dim)
        v = self.v(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        # SDPA picks flash/cuDNN/memory-efficient kernels on GPUs and a fused kernel on CPU.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if is_moe(cfg, layer) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """embed -> layers -> norm -> lm_head. A pipeline stage deletes the parts it does not run
    (setting embed, norm or lm_head to None and dropping layers); the names of the rest stay."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Keyed by layer index, so a stage that drops layers keeps the others' names.
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def tie_weights(self) -> None:
        """The output projection shares the embedding's weight (again after `to_empty`, which
        gives each module a parameter of its own)."""
        if self.cfg.tie_embeddings and self.embed is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed.weight

    def _inv_freq(self) -> torch.Tensor:
        return rope_frequencies(self.cfg.head_size, self.cfg.rope_theta, self.cfg.rope_scaling)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """tokens (batch, seq) int64, or the previous pipeline stage's hidden states -> logits
        (batch, seq, vocab), or the final hidden states with return_hidden (the loss then runs
        the head in chunks, kiln.train.loss) or when this stage has no head.

        positions (batch, seq): each token's position for RoPE (default 0..seq-1);
        document_ids (batch, seq): tokens attend only within their own document.
        """
        h = self.embed(tokens) if self.embed is not None else tokens
        cos, sin = rope_cos_sin(self.inv_freq, h.shape[1], positions)
        mask = document_mask(document_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is None or return_hidden:
            return h
        return self.lm_head(h)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, init_std) matrices (block output projections scaled by depth), ones for
        norms, zeros for biases, the RoPE buffer and the MoE layers' biases and counts.

        Each parameter is drawn from a generator seeded by (seed, its name), as a whole tensor,
        and each rank keeps its own slice: the same weights whatever the sharding or the
        number of pipeline stages.
        """
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim == 1:  # norm weights, biases
                full = torch.full(p.shape, 1.0 if "norm" in name else 0.0)
            else:
                scale = 1 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(
                    ("o.weight", "down.weight", "experts.down")) else 1
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(p.shape).normal_(0.0, std * scale, generator=gen)
            copy_full_into(p, full)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()

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


def count_parameters(cfg: ModelConfig, embedding: bool = True, active: bool = False) -> int:
    """Parameter count of the model `cfg` describes, computed from its shape alone; active:
    only those one token goes through (a mixture of experts' top_k of its experts)."""
    d, h, kv, hd = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    attn = d * h * hd + 2 * d * kv * hd + h * hd * d
    attn += (h * hd + 2 * kv * hd) if cfg.qkv_bias else 0
    attn += 2 * hd if cfg.qk_norm else 0
    blocks = sum(attn + ffn_parameters(cfg, i, active) + 2 * d for i in range(cfg.n_layers))
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return blocks + d + head + (cfg.vocab_size * d if embedding else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 x matmul weights + attention scores.

    Matmul weights are the linear layers' a token goes through (the output projection counts
    even when tied; the embedding lookup does not; of a mixture of experts only the router and
    the top_k experts, so MFU stays honest); attention adds 12 * layers * heads * head_dim *
    seq_len (PaLM).
    """
    d, h, kv, hd = cfg.dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    attn = 2 * d * h * hd + 2 * d * kv * hd
    matmul_weights = sum(attn + ffn_parameters(cfg, i, active=True) for i in range(cfg.n_layers))
    matmul_weights += cfg.vocab_size * d
    return 6 * matmul_weights + 12 * cfg.n_layers * h * hd * seq_len
