"""Hugging Face model directories out: what `AutoModelForCausalLM.from_pretrained` and serving
engines (vLLM, SGLang, TGI) load: config.json, safetensors shards with their index, tokenizer
files and generation_config.json.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file

from kiln.checkpoint.checkpointer import JOB_FILE, TOKENIZER_FILES, find_checkpoint, reader_for
from kiln.urls import is_url, redact
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.models.hf import hf_config_from_model, hf_model_type, to_hf_state_dict

DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
SHARD_BYTES = 4 * 2**30


def export_hf(source: str, out: str | Path, dtype: str = "bf16", endpoint_url: str | None = None,
              shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the model of a run, a checkpoint root or one checkpoint to `out` in HF format."""
    if dtype not in DTYPES:
        raise KilnError(f"export dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KilnError(f"{out} already exists and is not empty; choose a new output directory")
    model_cfg, weights, files = _read_source(str(source), endpoint_url)
    torch_dtype, dtype_name = DTYPES[dtype]
    model_type = hf_model_type(model_cfg)  # before any work: KilnError for shapes HF lacks
    state = {n: t.to(torch_dtype).contiguous()
             for n, t in to_hf_state_dict(weights, model_cfg.tie_embeddings, model_type).items()}

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    eos_id, bos_id = _write_tokenizer(tmp, files, model_cfg)
    _write_shards(tmp, state, shard_bytes)
    hf = hf_config_from_model(model_cfg, dtype_name, eos_id, bos_id)
    hf["dtype"] = dtype_name
    (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation = {"_from_model_config": False, "bos_token_id": bos_id, "eos_token_id": eos_id}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def _read_source(source: str, endpoint_url: str | None) -> tuple[ModelConfig, dict, dict[str, str]]:
    """(model config, our full state dict in fp32, tokenizer files by name) from a source."""
    run_config = Path(source) / "config.yaml"
    if not is_url(source) and run_config.is_file():
        cfg = _job(run_config.read_text(), str(run_config))
        root = cfg.checkpoint.dir or str(Path(source) / "checkpoints")
        found = find_checkpoint(root, endpoint_url or cfg.checkpoint.endpoint_url)
        if found is None:  # a run without checkpoints: its final weights
            weights_file = Path(source) / "model.safetensors"
            if not weights_file.is_file():
                raise KilnError(f"{source} has no committed checkpoint and no model.safetensors")
            files = {n: (Path(source) / n).read_text() for n in TOKENIZER_FILES
                     if (Path(source) / n).is_file()}
            return cfg.model, load_file(weights_file), files
    else:
        found = find_checkpoint(source, endpoint_url)
        if found is None:
            raise KilnError(f"{redact(source)} holds no committed checkpoint (step-NNNNNN "
                            "directories with a COMMITTED.json)")
    committed, storage = found
    text = storage.read_text(committed.step, JOB_FILE)
    if text is None:
        raise KilnError(f"checkpoint {redact(committed.url)} has no {JOB_FILE}: cannot tell its model shape")
    model_cfg = _job(text, f"{redact(committed.url)}/{JOB_FILE}").model
    files = {n: t for n in TOKENIZER_FILES if (t := storage.read_text(committed.step, n)) is not None}
    reader = reader_for(committed.url, storage.options)
    meta = reader.read_metadata().state_dict_metadata
    weights = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in meta.items() if k.startswith("model.")}
    state = {"model": weights}
    dcp.load(state, storage_reader=reader_for(committed.url, storage.options), no_dist=True)
    return model_cfg, state["model"], files


def _job(text: str, where: str) -> JobConfig:
    raw = yaml.safe_load(text)
    try:
        return JobConfig.model_validate(raw)
    except ValueError as e:
        raise KilnError(f"{where} is not a job config this kiln can read: {e}") from None


def _write_shards(directory: Path, state: dict[str, torch.Tensor], shard_bytes: int) -> None:
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(directory: Path, files: dict[str, str], model_cfg: ModelConfig):
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json; returns (eos_id, bos_id)."""
    if "tokenizer.json" not in files:
        print("kiln: warning: no tokenizer.json with this model; the export has weights only")
        return None, None
    from tokenizers import Tokenizer

    from kiln.data.tokenizer import describe

    config = json.loads(files.get("tokenizer_config.json", "{}"))
    info = describe(Tokenizer.from_str(files["tokenizer.json"]), config)
    eos = info.tokenizer.id_to_token(info.eos_id)
    bos = info.tokenizer.id_to_token(info.bos_id) if info.bos_id is not None else None
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("eos_token", eos)
    config.setdefault("model_max_length", model_cfg.max_seq_len)
    config.setdefault("clean_up_tokenization_spaces", False)
    special = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    (directory / "tokenizer.json").write_text(files["tokenizer.json"])
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return info.eos_id, info.bos_id
