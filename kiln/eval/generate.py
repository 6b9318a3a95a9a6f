"""Greedy decoding with a KV cache, built from the model's own modules.

Each new token attends to the keys and values cached for the tokens before it, so a reply of
n tokens costs n single-token forward passes, not n passes over the whole growing sequence.
The blocks' norms, projections and MLP are the model's modules; only the attention step is
redone here, with the cache (checked against the model's full forward in tests/test_eval.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.fused import rope
from kiln.models.transformer import rope_cos_sin


def _layers(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


class KVCache:
    """Keys and values per layer, (batch, kv_heads, max_len, head_dim), filled left to right."""

    def __init__(self, model: nn.Module, batch: int, max_len: int):
        cfg = model.cfg
        weight = model.embed.weight
        shape = (batch, cfg.kv_heads, max_len, cfg.head_size)
        self.k = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in _layers(model)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = 0


@torch.no_grad()
def forward_cached(model: nn.Module, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (batch, t, vocab) of `tokens`, which follow the cache's tokens; extends the cache."""
    b, t = tokens.shape
    start, end = cache.length, cache.length + t
    positions = torch.arange(start, end, device=tokens.device)
    cos, sin = rope_cos_sin(model.inv_freq, t, positions)
    # Query i sits at position start + i and sees keys 0 .. start + i.
    mask = torch.ones(t, end, dtype=torch.bool, device=tokens.device).tril(start)
    x = model.embed(tokens)
    for i, block in enumerate(_layers(model)):
        attn = block.attn
        h = block.attn_norm(x)
        q, k, v = (proj(h).view(b, t, -1, attn.head_dim) for proj in (attn.q, attn.k, attn.v))
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        cache.k[i][:, :, start:end] = k.transpose(1, 2)
        cache.v[i][:, :, start:end] = v.transpose(1, 2)
        q = q.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, cache.k[i][:, :, :end], cache.v[i][:, :, :end],
                                           attn_mask=mask, enable_gqa=q.shape[1] != k.shape[2])
        x = x + attn.o(y.transpose(1, 2).reshape(b, t, -1))
        x = x + block.mlp(block.mlp_norm(x))
    cache.length = end
    return model.lm_head(model.norm(x))


@torch.no_grad()
def greedy_generate(model: nn.Module, prompt: list[int], max_new_tokens: int,
                    stop_ids: set[int] = frozenset()) -> list[int]:
    """The greedy continuation of `prompt` (token ids), at most max_new_tokens, ending before
    the first stop id. The prompt is cut from the left to leave room in max_seq_len."""
    limit = model.cfg.max_seq_len
    max_new_tokens = min(max_new_tokens, limit - 1)
    prompt = prompt[-(limit - max_new_tokens):]
    device = model.embed.weight.device
    cache = KVCache(model, 1, len(prompt) + max_new_tokens)
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        if token in stop_ids:
            break
        out.append(token)
        logits = forward_cached(model, torch.tensor([[token]], device=device), cache)
    return out
