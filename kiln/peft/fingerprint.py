"""The fingerprint of a base model: a sha256 over its weights, which every adapter records.

Hashed under kiln's parameter names (a Hugging Face directory's names are mapped), tensor by
tensor (name, dtype, shape, bytes), so a kiln run's weights and their fp32 Hugging Face export
share one fingerprint, whatever the sharding of the files. Computed once and cached next to
the weights in `kiln-fingerprint.json`, keyed by the files' sizes and modification times.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.checkpoint.hf_import import read_hf_config, weight_files
from kiln.config import JobConfig
from kiln.errors import KilnError
from kiln.models.hf import from_hf_name

CACHE = "kiln-fingerprint.json"


def base_fingerprint(cfg: JobConfig) -> str:
    """The fingerprint of the base this job's adapters train on: model.init_from's weights,
    or, without one, the seeded initialisation (the model shape and train.seed)."""
    if cfg.model.init_from:
        return weights_fingerprint(cfg.model.init_from)
    described = json.dumps({"model": cfg.model.model_dump(mode="json"), "seed": cfg.train.seed},
                           sort_keys=True)
    return "init:" + hashlib.sha256(described.encode()).hexdigest()


def weights_fingerprint(directory: str | Path) -> str:
    """The fingerprint of a Hugging Face model directory or a kiln run's model.safetensors."""
    directory = Path(directory)
    hf = (directory / "config.json").is_file()
    files = weight_files(directory) if hf else [directory / "model.safetensors"]
    if not files[0].is_file():
        raise KilnError(f"{directory} holds neither a Hugging Face model (config.json + "
                        "safetensors) nor a kiln run's model.safetensors: no base weights to fingerprint")
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    cache = directory / CACHE
    try:
        cached = json.loads(cache.read_text())
        if cached["files"] == stamp:
            return cached["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tie = bool(read_hf_config(directory).get("tie_word_embeddings")) if hf else False
    fingerprint = "sha256:" + _hash(files, hf, tie)
    tmp = directory / f".{CACHE}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "files": stamp}, indent=2) + "\n")
        tmp.replace(cache)
    except OSError:  # a read-only base: hashed again next time
        tmp.unlink(missing_ok=True)
    return fingerprint


def _hash(files: list[Path], hf: bool, tie: bool) -> str:
    where: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq"):
                    continue
                try:
                    name = from_hf_name(key) if hf else key
                except KeyError as e:
                    raise KilnError(f"{file}: {e.args[0]}") from None
                if not (tie and name == "lm_head.weight"):  # the embedding's, when tied
                    where[name] = (file, key)
    digest = hashlib.sha256()
    for name in sorted(where):
        file, key = where[name]
        with safe_open(str(file), framework="pt") as f:
            t = f.get_tensor(key).contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
