"""Hugging Face model directories in: config.json + safetensors (one file or an index of shards).

`model.init_from: DIR` takes the shape from DIR/config.json and the weights from its
safetensors, for continued pretraining or fine-tuning; `kiln import-hf DIR` writes such a job.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from torch import nn

from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.models.hf import from_hf_state_dict, model_config_from_hf, to_hf_names
from kiln.parallel.dtensor import copy_full_into

INDEX = "model.safetensors.index.json"


def read_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise KilnError(f"cannot read {path} ({e.strerror or e}); expected a "
                        "Hugging Face model directory (config.json + *.safetensors)") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None


def hf_model_fields(directory: str | Path) -> dict:
    """ModelConfig fields from DIR/config.json (what `model.init_from` fills in)."""
    cfg = model_config_from_hf(read_hf_config(directory))
    return cfg.model_dump(exclude={"preset", "init_from"})


def resolve_init_from(cfg: JobConfig) -> JobConfig:
    """The job with model.init_from's shape filled in from its config.json.

    Fields the job sets itself override the directory's (like a preset). Idempotent: a job
    resolved once resolves to itself.
    """
    model = cfg.model
    if model.init_from is None:
        return cfg
    explicit = model.model_dump(include=model.model_fields_set)
    try:
        resolved = ModelConfig.model_validate({**hf_model_fields(model.init_from), **explicit})
    except ValueError as e:
        raise KilnError(f"model.init_from {model.init_from}: {e}") from None
    if cfg.data.seq_len > resolved.max_seq_len:
        raise KilnError(f"data.seq_len={cfg.data.seq_len} exceeds the max_seq_len of "
                        f"model.init_from {model.init_from} ({resolved.max_seq_len})")
    return cfg.model_copy(update={"model": resolved})


def weight_files(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise KilnError(f"{index} is not a safetensors index ({e})") from None
        files = [directory / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise KilnError(f"{directory} holds no model.safetensors or {INDEX} (only safetensors "
                    "weights are read; convert .bin checkpoints with transformers first)")


def check_fit(expected: dict[str, tuple], found: dict[str, tuple], directory) -> None:
    """KilnError naming what is missing, unexpected or of the wrong shape (names are ours)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{n} {list(found[n])} (model: {list(expected[n])})" for n in found
             if n in expected and tuple(found[n]) != tuple(expected[n])]
    parts = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
            ([f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []) + \
            ([f"wrong shape {', '.join(wrong[:3])}"] if wrong else [])
    if parts:
        raise KilnError(f"the weights in {directory} do not fit the model its config.json "
                        f"describes (with this job's model overrides): {'; '.join(parts)}")


def _ours(state: dict, tie: bool, directory) -> dict:
    try:
        return from_hf_state_dict(state, tie)
    except KeyError as e:
        raise KilnError(f"{directory}: {e.args[0]}") from None


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str | Path) -> None:
    """Copy the weights of a Hugging Face directory into our model (cast to its dtype).

    One tensor at a time, memory-mapped from the safetensors files (the experts of a mixture:
    one matrix of all experts at a time, stacked from the file's per-expert tensors); a sharded
    model (FSDP2, tensor parallel) keeps only its own slice of each, so the whole model is
    never in memory.
    """
    tie = model.cfg.tie_embeddings
    model_type = read_hf_config(directory).get("model_type")
    n_experts = model.cfg.moe.n_experts if model.cfg.moe else 0
    found: dict[str, tuple[Path, str]] = {}
    shapes: dict[str, tuple] = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                shapes[hf_name] = tuple(f.get_slice(hf_name).get_shape())
                found[hf_name] = (file, hf_name)
    ours = _ours({n: torch.empty(s, device="meta") for n, s in shapes.items()}, tie, directory)
    expected = dict(model.named_parameters())
    check_fit({n: tuple(p.shape) for n, p in expected.items()},
              {n: tuple(t.shape) for n, t in ours.items() if not (tie and n == "lm_head.weight")},
              directory)
    for name, param in expected.items():
        tensors = []
        for hf_name in to_hf_names(name, model_type, n_experts):
            file, _ = found[hf_name]
            with safe_open(str(file), framework="pt") as f:
                tensors.append(f.get_tensor(hf_name))
        copy_full_into(param, tensors[0] if len(tensors) == 1 else torch.stack(tensors))


def job_yaml(directory: str | Path) -> str:
    """A starting job that continues training the model in DIR, checked to load."""
    directory = Path(directory).resolve()
    fields = hf_model_fields(directory)
    from kiln.models.transformer import Transformer, count_parameters

    cfg = ModelConfig(**fields)
    with torch.device("meta"):
        expected = {n: t.shape for n, t in Transformer(cfg).state_dict().items()}
    # Check names and shapes from the safetensors headers alone, without reading the weights.
    found = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                found[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    ours = _ours(found, cfg.tie_embeddings, directory)
    check_fit(expected, {n: t.shape for n, t in ours.items()}, directory)
    model_type = read_hf_config(directory)["model_type"]
    job = {
        "name": directory.name,
        "model": {"init_from": str(directory)},
        "data": {"source": "shards", "tokenizer": str(directory), "seq_len": min(fields["max_seq_len"], 2048),
                 "sources": [{"name": "train", "path": "data/prepared"}],
                 "val": [{"name": "val", "path": "data/prepared"}]},
        "optim": {"lr": 3.0e-5},
        "schedule": {"warmup_steps": 20},
        "train": {"max_steps": 1000, "micro_batch_size": 1},
    }
    return (f"# Launch: kiln train <this file>\n"
            f"# Continues training {directory} ({count_parameters(cfg) / 1e6:.1f}M parameters, "
            f"{model_type}).\n# Prepare the data first, with the model's own tokenizer:\n"
            f"#   kiln prepare YOUR_FILES --tokenizer {directory} --out data/prepared --val-fraction 0.01\n"
            + yaml.safe_dump(job, sort_keys=False))
