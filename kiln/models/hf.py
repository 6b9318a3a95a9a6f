"""Hugging Face Llama/Mistral/Qwen2/Qwen3/Mixtral/Qwen3-MoE configs and weight names <-> ours.

The layouts agree (RoPE rotates halves in both), so the weight map is a rename, no permutation,
except for the experts of a mixture: HF checkpoints hold one tensor per expert and matrix
(experts.{j}.w1, ...), we hold each matrix of all experts stacked (experts.gate, ...).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from pydantic import ValidationError

from kiln.config import ModelConfig
from kiln.errors import KilnError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


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
    moe = _moe_from_hf(hf) if kind in MOE_NAMES else None
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim"), intermediate_size=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=theta,
            rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
            qkv_bias=kind == "qwen2" or bool(hf.get("attention_bias", False)),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'the shape'}: "
                             f"{err['msg'].removeprefix('Value error, ')}" for err in e.errors())
        raise KilnError(f"{where} describes a model kiln cannot build ({problems}; the names "
                        "are kiln's model fields)") from None


def _moe_from_hf(hf: dict) -> dict:
    kind = hf["model_type"]
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    moe = dict(n_experts=experts, top_k=hf["num_experts_per_tok"],
               aux_loss_coef=hf.get("router_aux_loss_coef", 0.001))
    if kind == "mixtral":  # every layer a mixture; the top-k weights always renormalised
        return dict(moe, intermediate_size=hf["intermediate_size"], norm_topk_prob=True)
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))) or hf.get("decoder_sparse_step", 1) != 1:
        raise KilnError(f"qwen3_moe with mlp_only_layers={dense} and decoder_sparse_step="
                        f"{hf.get('decoder_sparse_step')}: only the first k layers may be dense "
                        "(mlp_only_layers = [0, ..., k-1], decoder_sparse_step = 1)")
    return dict(moe, intermediate_size=hf["moe_intermediate_size"], first_k_dense=len(dense),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


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


@dataclass(frozen=True)
class MoENames:
    """A mixture family's HF names: the router's, and each expert's matrices ({j} the expert)."""

    router: str
    experts: dict[str, str]
    """Our stacked matrix (gate, up, down) -> the HF name of one expert's slice."""


MOE_NAMES = {
    "mixtral": MoENames("model.layers.{i}.block_sparse_moe.gate.weight", {
        x: f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight"
        for x, w in (("gate", "w1"), ("down", "w2"), ("up", "w3"))}),
    "qwen3_moe": MoENames("model.layers.{i}.mlp.gate.weight", {
        x: f"model.layers.{{i}}.mlp.experts.{{j}}.{x}_proj.weight" for x in ("gate", "up", "down")}),
}
ROUTER = "layers.{i}.mlp.router.weight"
STACKED = "layers.{i}.mlp.experts.{x}"


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for key, group in (("i", r"(?P<i>\d+)"), ("j", r"(?P<j>\d+)"), ("x", r"(?P<x>gate|up|down)")):
        pattern = pattern.replace(r"\{" + key + r"\}", group)
    return re.compile("^" + pattern + "$")


@functools.cache
def _to_hf_table(model_type: str | None) -> list[tuple[re.Pattern, str]]:
    names = _NAMES + ([(ROUTER, MOE_NAMES[model_type].router)] if model_type in MOE_NAMES else [])
    return [(_compile(ours), hf) for ours, hf in names]


_FROM_HF = [(_compile(hf), ours) for ours, hf in
            _NAMES + [(ROUTER, names.router) for names in MOE_NAMES.values()]]
_EXPERTS_FROM_HF = [(_compile(hf), x) for names in MOE_NAMES.values() for x, hf in names.experts.items()]
_STACKED = _compile(STACKED)


def _rename(name: str, table: list[tuple[re.Pattern, str]]) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.format(**m.groupdict())
    raise KeyError(f"no Hugging Face name mapping for weight {name!r}")


def to_hf_names(name: str, model_type: str | None = None, n_experts: int = 0) -> list[str]:
    """The HF names of our weight `name`: one, or for stacked experts one per expert, in order."""
    m = _STACKED.match(name)
    if m is None:
        return [_rename(name, _to_hf_table(model_type))]
    if model_type not in MOE_NAMES:
        raise KeyError(f"expert weight {name!r} has no Hugging Face name in a "
                       f"{model_type or 'dense'} model")
    template = MOE_NAMES[model_type].experts[m["x"]]
    return [template.format(i=m["i"], j=j) for j in range(n_experts)]


def from_hf_name(name: str) -> str:
    return _rename(name, _FROM_HF)


def _expert_slice(hf_name: str) -> tuple[str, int] | None:
    """(our stacked name, expert index) when `hf_name` is one expert's matrix."""
    for pattern, x in _EXPERTS_FROM_HF:
        if m := pattern.match(hf_name):
            return STACKED.format(i=m["i"], x=x), int(m["j"])
    return None


def from_hf_state_dict(state: dict, tie_embeddings: bool) -> dict:
    """An HF state dict renamed to ours, each expert matrix stacked over the experts; a tied
    lm_head is the embedding, whatever the file holds."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.endswith("rotary_emb.inv_freq") or (tie_embeddings and name == "lm_head.weight"):
            continue
        expert = _expert_slice(name)
        if expert:
            experts.setdefault(expert[0], {})[expert[1]] = tensor
        else:
            out[from_hf_name(name)] = tensor
    for ours, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
            raise KeyError(f"experts {missing} of {ours!r} are missing")
        out[ours] = torch.stack([by_index[j] for j in range(len(by_index))])
    if tie_embeddings and "embed.weight" in out:
        out["lm_head.weight"] = out["embed.weight"]
    return out


def to_hf_state_dict(state: dict, tie_embeddings: bool, model_type: str | None = None) -> dict:
    """Our state dict under the HF names of `model_type` (hf_model_type), stacked experts split
    into one tensor per expert; a tied lm_head is left out, as HF checkpoints do."""
    out = {}
    for name, tensor in state.items():
        if tie_embeddings and name == "lm_head.weight":
            continue
        names = to_hf_names(name, model_type, tensor.shape[0])
        if _STACKED.match(name):  # copies: safetensors refuses tensors that share storage
            out.update((n, t.clone()) for n, t in zip(names, tensor.unbind(0)))
        else:
            out[names[0]] = tensor
    return out


def hf_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type our config exports as; KilnError when none has its shape.

    Dense: qk_norm -> qwen3, qkv_bias -> qwen2, otherwise llama (which also serves Mistral's
    shape). Mixture of experts: qk_norm -> qwen3_moe, otherwise mixtral.
    """
    if cfg.qk_norm and cfg.qkv_bias:
        raise KilnError("no Hugging Face architecture has both q/k/v bias and q/k norm "
                        "(model.qkv_bias and model.qk_norm); cannot export this model")
    m = cfg.moe
    if m is None:
        return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    unsupported = [f"model.moe.{field}={value}" for field, value, ok in (
        ("gating", m.gating, m.gating == "softmax"),
        ("n_shared_experts", m.n_shared_experts, m.n_shared_experts == 0),
        ("bias_update_rate", m.bias_update_rate, m.bias_update_rate == 0),
        ("qkv_bias", cfg.qkv_bias, not cfg.qkv_bias)) if not ok]
    if not cfg.qk_norm and (m.first_k_dense or not m.norm_topk_prob):
        unsupported.append(f"without qk_norm (Mixtral): model.moe.first_k_dense={m.first_k_dense}, "
                           f"norm_topk_prob={m.norm_topk_prob} (Mixtral: 0, true)")
    if unsupported:
        raise KilnError("this mixture of experts has no Hugging Face architecture kiln exports "
                        "(Mixtral, or Qwen3-MoE with qk_norm: softmax gating, no shared experts, "
                        f"no routing bias): {'; '.join(unsupported)}")
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config_from_model(cfg: ModelConfig, dtype: str = "bfloat16", eos_token_id: int | None = None,
                         bos_token_id: int | None = None) -> dict:
    """The Hugging Face config.json for our ModelConfig (the reverse of model_config_from_hf)."""
    kind = hf_model_type(cfg)
    hf = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": cfg.vocab_size,
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
    m = cfg.moe
    if m is not None:  # the load-balancing loss is computed only when asked for, as trained
        hf.update(num_experts_per_tok=m.top_k, router_aux_loss_coef=m.aux_loss_coef,
                  output_router_logits=False)
    if kind == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif kind == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    elif kind == "mixtral":  # intermediate_size is each expert's; every layer is a mixture
        hf.update(intermediate_size=m.intermediate_size or cfg.intermediate_size,
                  num_local_experts=m.n_experts, sliding_window=None, router_jitter_noise=0.0)
    else:
        hf.update(attention_bias=False, use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.n_layers)
    if kind == "qwen3_moe":
        hf.update(num_experts=m.n_experts, moe_intermediate_size=m.intermediate_size or cfg.intermediate_size,
                  norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=list(range(m.first_k_dense)))
    return hf
