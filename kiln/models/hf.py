"""Hugging Face Llama/Mistral/Qwen2/Qwen3 configs and weight names <-> ours.

The layouts agree (RoPE rotates halves in both), so the weight map is a rename, no permutation.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from kiln.config import ModelConfig
from kiln.errors import KilnError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from the fields of a Hugging Face config.json (read from `where`)."""
    if not isinstance(hf, dict):
        raise KilnError(f"{where} holds a JSON {type(hf).__name__}, not an object of model "
                        "settings")
    kind = hf.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise KilnError(f"{where}: model_type {kind!r} is not supported; supported: "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise KilnError(f"{where} lacks {', '.join(missing)}: not a complete {kind} config")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise KilnError(f"{where}: rope_scaling is a {type(rope).__name__}, not an object")
    rope_type = rope.get("rope_type", rope.get("type"))
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        absent = [k for k in keys if k not in rope]
        if absent:
            raise KilnError(f"{where}: llama3 rope_scaling lacks {', '.join(absent)}")
        scaling = dict(type="llama3", factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                       high_freq_factor=rope["high_freq_factor"],
                       original_max_seq_len=rope["original_max_position_embeddings"])
    elif rope_type not in (None, "default"):
        raise KilnError(f"{where}: rope scaling {rope_type!r} is not supported (only llama3)")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"), intermediate_size=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=theta,
            rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=kind == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=kind == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'the shape'}: "
                             f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise KilnError(f"{where} describes a model kiln cannot build ({problems}; the names "
                        "are kiln's model fields)") from None


# (ours, Hugging Face); {i} is the layer index.
_NAMES = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    *[(f"layers.{{i}}.attn.{x}.{p}", f"model.layers.{{i}}.self_attn.{x}_proj.{p}")
      for x in "qkvo" for p in ("weight", "bias")],
    *[(f"layers.{{i}}.mlp.{x}.weight", f"model.layers.{{i}}.mlp.{x}_proj.weight")
      for x in ("gate", "up", "down")],
]


def _compile(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in _NAMES]
_FROM_HF = [(_compile(hf), ours) for ours, hf in _NAMES]


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(i=m.group(1)) if m.groups() else target
    raise KeyError(f"no Hugging Face name mapping for weight {name!r}")


def to_hf_name(name: str) -> str:
    return _rename(name, _TO_HF)


def from_hf_name(name: str) -> str:
    return _rename(name, _FROM_HF)


def from_hf_state_dict(state: dict, tie_embeddings: bool) -> dict:
    """An HF state dict renamed to ours; a tied lm_head is the embedding, whatever the file holds."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight"):
            continue
        out[from_hf_name(name)] = tensor
    if tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def to_hf_state_dict(state: dict, tie_embeddings: bool) -> dict:
    """Our state dict under HF names; a tied lm_head is left out, as HF checkpoints do."""
    return {to_hf_name(n): t for n, t in state.items()
            if not (tie_embeddings and n == "lm_head.weight")}


def hf_config_from_model(cfg: ModelConfig, dtype: str = "bfloat16", eos_token_id: int | None = None,
                         bos_token_id: int | None = None) -> dict:
    """The Hugging Face config.json for our ModelConfig (the reverse of model_config_from_hf).

    qk_norm -> Qwen3, qkv_bias -> Qwen2, otherwise Llama (which also serves Mistral's shape).
    """
    if cfg.qk_norm and cfg.qkv_bias:
        raise KilnError("no Hugging Face architecture has both q/k/v bias and q/k norm "
                        "(model.qkv_bias and model.qk_norm); cannot export this model")
    kind, arch = (("qwen3", "Qwen3ForCausalLM") if cfg.qk_norm else
                  ("qwen2", "Qwen2ForCausalLM") if cfg.qkv_bias else ("llama", "LlamaForCausalLM"))
    hf = {
        "architectures": [arch], "model_type": kind, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                              "low_freq_factor": s.low_freq_factor,
                              "high_freq_factor": s.high_freq_factor,
                              "original_max_position_embeddings": s.original_max_seq_len}
    if kind == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif kind == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    else:
        hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.n_layers)
    return hf
