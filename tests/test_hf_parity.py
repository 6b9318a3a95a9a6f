"""Our transformer against Hugging Face `transformers` as the reference, for each family."""

import pytest
import torch
import transformers

from kiln.models.hf import from_hf_state_dict, model_config_from_hf, to_hf_state_dict
from kiln.models.transformer import Transformer, count_parameters

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=160, max_position_embeddings=128)

FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, dict(rope_theta=1e6, sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, rope_theta=1e6)),
}


def hf_model(family: str) -> transformers.PreTrainedModel:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # HF zero-inits biases and ones norms; make every weight count.
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    reference = hf_model(family)
    cfg = model_config_from_hf(reference.config.to_dict())
    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(reference.state_dict(), cfg.tie_embeddings))
    assert count_parameters(cfg) == sum(p.numel() for p in reference.parameters())

    tokens = torch.randint(0, TINY["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = ours(tokens)
    rel = (got - expected).norm() / expected.norm()
    assert rel < 1e-5, f"{family}: relative error {rel:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_names_round_trip(family):
    reference = hf_model(family)
    cfg = model_config_from_hf(reference.config.to_dict())
    ours = from_hf_state_dict(reference.state_dict(), cfg.tie_embeddings)
    back = to_hf_state_dict(ours, cfg.tie_embeddings)
    expected = {k for k in reference.state_dict() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    assert set(back) == expected
