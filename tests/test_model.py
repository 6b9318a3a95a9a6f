"""Model sizes and FLOPs: presets against transformers, FLOPs against PyTorch's flop counter."""

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kiln.config import ModelConfig
from kiln.models.transformer import Transformer, count_parameters, flops_per_token

HF_CLASSES = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config}


def hf_config(cfg: ModelConfig, family: str):
    return HF_CLASSES[family](
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size, intermediate_size=cfg.intermediate_size,
        tie_word_embeddings=cfg.tie_embeddings)


@pytest.mark.parametrize("preset, family, published", [
    ("llama-3.2-1b", "llama", 1.24e9),
    ("llama-3.1-8b", "llama", 8.03e9),
    ("qwen2.5-0.5b", "qwen2", 0.49e9),
    ("qwen3-0.6b", "qwen3", 0.60e9),
])
def test_preset_parameter_count_matches_transformers(preset, family, published):
    cfg = ModelConfig(preset=preset)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(hf_config(cfg, family))
        ours = Transformer(cfg)
    expected = sum(p.numel() for p in reference.parameters())
    assert count_parameters(cfg) == expected == sum(p.numel() for p in ours.parameters())
    assert count_parameters(cfg) == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_flop_counter(tied):
    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=160, max_seq_len=128, tie_embeddings=tied)
    model = Transformer(cfg)
    seq = 128
    tokens = torch.randint(0, cfg.vocab_size, (1, seq))
    # The math backend runs attention as matmuls the counter sees.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).sum().backward()
    assert counter.get_total_flops() / seq == pytest.approx(flops_per_token(cfg, seq), rel=0.01)
