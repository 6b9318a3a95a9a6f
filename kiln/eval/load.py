"""A model to evaluate, from a run directory, a checkpoint or a Hugging Face directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from kiln.urls import is_url
from kiln.data.tokenizer import TokenizerInfo, describe, load_tokenizer
from kiln.errors import KilnError
from kiln.models.transformer import Transformer


@dataclass
class Loaded:
    model: Transformer
    tokenizer: TokenizerInfo
    step: int | None
    """The checkpoint's step (a run's last logged step for its final weights); None for HF."""
    run_dir: Path | None
    """The run it belongs to: its trackers get the results."""


def load_for_eval(target: str, device: str = "cpu", endpoint_url: str | None = None) -> Loaded:
    """A run directory, a checkpoint root, a step-NNNNNN checkpoint or a Hugging Face directory."""
    path = Path(target)
    if not is_url(target) and (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        from kiln.checkpoint.hf_import import load_hf_weights, read_hf_config
        from kiln.models.hf import model_config_from_hf

        model = Transformer(model_config_from_hf(read_hf_config(path)))
        load_hf_weights(model, path)
        return Loaded(model.to(device).eval(), load_tokenizer(path), None, None)
    if not is_url(target) and not path.exists():
        raise KilnError(f"{target} does not exist: expected a run directory, a checkpoint or a "
                        "Hugging Face model directory")
    from kiln.checkpoint.hf_export import read_model
    from kiln.tracking.jsonl import read_metrics

    found = read_model(target, endpoint_url)
    if "tokenizer.json" not in found.files:
        raise KilnError(f"{target} has no tokenizer.json: cannot turn task text into tokens")
    config = json.loads(found.files.get("tokenizer_config.json", "{}"))
    tokenizer = describe(Tokenizer.from_str(found.files["tokenizer.json"]), config, target)
    weights = found.weights
    if found.job.peft.method != "full":  # an adapter run: its base with the adapter folded in
        from kiln.peft.export import merged_weights

        weights = merged_weights(found.job, weights, found.files, target)
    model = Transformer(found.model_cfg)
    model.load_state_dict({k: v.float() for k, v in weights.items()})
    step = found.step
    if step is None and found.run_dir is not None:
        steps = [r["step"] for r in read_metrics(found.run_dir) if isinstance(r.get("step"), int)]
        step = max(steps, default=None)
    return Loaded(model.to(device).eval(), tokenizer, step, found.run_dir)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
