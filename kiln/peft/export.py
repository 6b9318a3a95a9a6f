"""An adapter run out: the PEFT format (`adapter_config.json` + `adapter_model.safetensors`
under Hugging Face module names), which `peft.PeftModel.from_pretrained` loads onto the base
and LoRA-serving engines accept, or the base with the adapter merged in."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.config import JobConfig
from kiln.errors import KilnError
from kiln.models.hf import to_hf_names
from kiln.peft.adapter import ADAPTER_FILE, EXPORTED_FILE, AdapterInfo, check_base
from kiln.peft.lora import ADAPTER_PARAMS, is_adapter_name, merge_tuning

HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "lm_head": "lm_head",
              "embed": "embed_tokens"}


def peft_name(name: str) -> str:
    """layers.0.attn.q.lora_A.weight -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight,
    embed.lora_embedding_A -> base_model.model.model.embed_tokens.lora_embedding_A"""
    leaf = next(p for p in ADAPTER_PARAMS if name.endswith("." + p))
    module = name[: -len(leaf) - 1]
    hf_module = to_hf_names(f"{module}.weight")[0].removesuffix(".weight")
    return f"base_model.model.{hf_module}.{leaf}"


def adapter_config(cfg: JobConfig) -> dict:
    """PEFT's LoraConfig for this run, as adapter_config.json holds it."""
    p = cfg.peft
    base = str(Path(cfg.model.init_from).resolve()) if cfg.model.init_from else None
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": p.rank, "lora_alpha": p.alpha, "lora_dropout": p.dropout, "use_rslora": p.rslora,
        "use_dora": p.method == "dora", "target_modules": sorted(HF_MODULES[t] for t in p.target_modules),
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


def adapter_info(files: dict[str, str], where: str) -> AdapterInfo:
    if ADAPTER_FILE not in files:
        raise KilnError(f"{where} is an adapter run but carries no {ADAPTER_FILE} (the record of "
                        "its base); it was not written by this kiln")
    return AdapterInfo.from_json(files[ADAPTER_FILE], f"{where}/{ADAPTER_FILE}")


def write_adapter(directory: Path, cfg: JobConfig, weights: dict[str, torch.Tensor],
                  files: dict[str, str], dtype: torch.dtype, where: str) -> None:
    """adapter_model.safetensors, adapter_config.json and kiln-adapter.json into directory."""
    info = adapter_info(files, where)
    if cfg.model.init_from is None:
        print("kiln: note: this adapter's base is the seeded initialisation, not a model "
              "directory: adapter_config.json names no base_model_name_or_path")
    elif cfg.peft.method == "qlora":
        print("kiln: note: a QLoRA adapter was trained against the NF4-quantised base; loaded "
              "onto the full-precision base its outputs differ by the quantisation error (load "
              "the base in 4-bit, or export with --merge)")
    state = {peft_name(n): t.to(dtype).contiguous() for n, t in weights.items() if is_adapter_name(n)}
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config(cfg), indent=2) + "\n")
    info.write(directory, EXPORTED_FILE)


def merged_weights(cfg: JobConfig, weights: dict[str, torch.Tensor], files: dict[str, str],
                   where: str) -> dict[str, torch.Tensor]:
    """The base's state dict (our names, fp32) with the adapter folded into each target layer.

    The base is rebuilt as training built it (model.init_from, or the seeded initialisation),
    after checking its fingerprint; for QLoRA it is quantised to NF4 and dequantised again, so
    the merged model computes what the trained one did.
    """
    from kiln.peft.fingerprint import base_fingerprint
    from kiln.train.build import build_model

    info = adapter_info(files, where)
    check_base(info, base_fingerprint(cfg), cfg.model.init_from, where)
    plain = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"activation_checkpointing": False, "compile": False})})
    model = build_model(plain, None, torch.device("cpu"))
    result = model.load_state_dict(weights, strict=False)
    missing = [n for n in result.missing_keys if is_adapter_name(n)]
    if missing or result.unexpected_keys:
        raise KilnError(f"{where}: the saved adapter does not fit the model its job describes "
                        f"(missing {missing[:3]}, unexpected {result.unexpected_keys[:3]})")
    merge_tuning(model)
    return {n: t.detach().float() for n, t in model.state_dict().items()}


def merged_model_config(cfg: JobConfig, model_cfg):
    """The merged model's shape: an adapter on a tied lm_head or embedding gives that side a
    weight of its own, so the merged model is untied."""
    if {"lm_head", "embed"} & set(cfg.peft.target_modules) and model_cfg.tie_embeddings:
        print("kiln: note: an adapter on the tied embedding or lm_head is merged into that side "
              "only; the merged model no longer ties the two (one more vocab x dim matrix)")
        return model_cfg.model_copy(update={"tie_embeddings": False})
    return model_cfg
