"""Hugging Face model directories in: config.json + safetensors (one file or an index of shards).

`model.init_from: DIR` takes the shape from DIR/config.json and the weights from its
safetensors, for continued pretraining or fine-tuning; `kiln import-hf DIR` writes such a job.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors import SafetensorError, safe_open
from torch import nn

from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.models.hf import from_hf_state_dict, model_config_from_hf, to_hf_names
from kiln.parallel.dtensor import copy_full_into
from kiln.peft.lora import is_adapter_name

INDEX = "model.safetensors.index.json"


def read_hf_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise KilnError(f"{directory} is not a directory; expected a Hugging Face model "
                        "directory (config.json + *.safetensors)")
    try:
        return json.loads(path.read_bytes())
    except OSError as e:
        raise KilnError(f"cannot read {path} ({e.strerror or e}); expected a "
                        "Hugging Face model directory (config.json + *.safetensors)") from None
    except json.JSONDecodeError as e:
        raise KilnError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    except ValueError as e:  # bytes that are not UTF-8
        raise KilnError(f"{path} is not a JSON text file ({e})") from None


def hf_model_fields(directory: str | Path) -> dict:
    """ModelConfig fields from DIR/config.json (what `model.init_from` fills in)."""
    cfg = model_config_from_hf(read_hf_config(directory), str(Path(directory) / "config.json"))
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
            names = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KilnError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
        if not all(isinstance(n, str) for n in names):
            raise KilnError(f"{index}: weight_map values must be file names")
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


def unreadable(file: Path, error: Exception) -> KilnError:
    """A safetensors file that cannot be read: most often a download or copy cut short."""
    return KilnError(f"{file} is not a readable safetensors file ({error}); it may be truncated "
                     "or damaged: copy or download it again")


def header_shapes(directory: str | Path) -> dict[str, tuple[Path, tuple]]:
    """{HF name: (file, shape)} from the safetensors headers alone, no weights read."""
    found = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    found[name] = (file, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise unreadable(file, e) from None
    return found


def shape_problems(expected: dict[str, tuple], found: dict[str, tuple]) -> list[str]:
    """What is missing, unexpected or of the wrong shape in `found` (at most 3 of each)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [f"{n} {list(found[n])} (model: {list(expected[n])})" for n in found
             if n in expected and tuple(found[n]) != tuple(expected[n])]
    return ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
           ([f"unexpected {', '.join(unexpected[:3])}"] if unexpected else []) + \
           ([f"wrong shape {', '.join(wrong[:3])}"] if wrong else [])


def check_fit(expected: dict[str, tuple], found: dict[str, tuple], directory) -> None:
    """KilnError naming what is missing, unexpected or of the wrong shape (names are ours)."""
    parts = shape_problems(expected, found)
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
    found = header_shapes(directory)
    model_type = read_hf_config(directory).get("model_type")
    n_experts = model.cfg.moe.n_experts if model.cfg.moe else 0
    ours = _ours({n: torch.empty(s, device="meta") for n, (_, s) in found.items()}, tie, directory)
    from kiln.models.transformer import Transformer

    with torch.device("meta"):  # a pipeline stage holds part of the model: check the whole
        whole = dict(Transformer(model.cfg).named_parameters())
    # An adapter's own parameters (kiln.peft) are not in a base model's files.
    expected = {n: p for n, p in model.named_parameters() if not is_adapter_name(n)}
    check_fit({n: tuple(p.shape) for n, p in whole.items()},
              {n: tuple(t.shape) for n, t in ours.items() if not (tie and n == "lm_head.weight")},
              directory)
    for name, param in expected.items():
        tensors = []
        for hf_name in to_hf_names(name, model_type, n_experts):  # experts: one tensor each in HF
            file = found[hf_name][0]
            try:
                with safe_open(str(file), framework="pt") as f:
                    tensors.append(f.get_tensor(hf_name))
            except (SafetensorError, OSError) as e:
                raise unreadable(file, e) from None
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
    found = {n: torch.empty(shape, device="meta") for n, (_, shape) in header_shapes(directory).items()}
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
