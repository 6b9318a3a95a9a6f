"""Hugging Face model directories out: what `AutoModelForCausalLM.from_pretrained` and serving
engines (vLLM, SGLang, TGI) load: config.json, safetensors shards with their index, tokenizer
files, generation_config.json, and lineage.json (which run and step it came from, and that
run's own lineage).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kiln.checkpoint.checkpointer import JOB_FILE, RUN_FILES, find_checkpoint, reader_for
from kiln.checkpoint.hf_import import shape_problems, unreadable
from kiln.urls import is_url, redact
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError, os_error
from kiln.outputs import check_output_dir
from kiln.models.hf import hf_config_from_model, hf_model_type, to_hf_state_dict
from kiln.tracking.lineage import record_export, write_lineage

@dataclass
class ModelSource:
    """A model read from a run, a checkpoint root or one checkpoint."""

    model_cfg: ModelConfig
    weights: dict
    """Our full state dict, fp32; an adapter run's: its adapter alone (kiln.peft)."""
    files: dict[str, str]
    """Tokenizer files (and an adapter run's adapter.json) by name."""
    step: int | None
    """The checkpoint's step; None for a run's final weights without a checkpoint."""
    run_dir: Path | None
    """The local run directory it belongs to, when there is one."""
    job: JobConfig
    """The whole job: its tuning method says whether the weights are a model or an adapter."""


DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
SHARD_BYTES = 4 * 2**30


def export_hf(source: str, out: str | Path, dtype: str = "bf16", endpoint_url: str | None = None,
              shard_bytes: int = SHARD_BYTES, merge: bool = False) -> Path:
    """Write the model of a run, a checkpoint root or one checkpoint to `out` in HF format.

    An adapter run (peft.method lora/dora/qlora) is written as a PEFT adapter directory, or
    with merge as the whole model with the adapter folded into its base (kiln.peft.export).
    """
    if dtype not in DTYPES:
        raise KilnError(f"export dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    out = check_output_dir(out, "the output directory")
    if out.exists() and any(out.iterdir()):
        raise KilnError(f"{out} already exists and is not empty; choose a new output directory")
    found = read_model(str(source), endpoint_url)
    model_cfg, weights, files, cfg = found.model_cfg, found.weights, found.files, found.job
    torch_dtype, dtype_name = DTYPES[dtype]
    model_type = hf_model_type(model_cfg)  # before any work: KilnError for shapes HF lacks
    adapter = cfg.peft.method != "full"
    if merge and not adapter:
        raise KilnError(f"--merge: {redact(str(source))} is a full fine-tuning run (peft.method "
                        "full), with no adapter to merge; export it without --merge")
    if adapter:
        from kiln.peft import export as peft_export

        if merge:
            weights = peft_export.merged_weights(cfg, weights, files, redact(str(source)))
            model_cfg = peft_export.merged_model_config(cfg, model_cfg)

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        eos_id, bos_id = _write_tokenizer(tmp, files, model_cfg)
        if adapter and not merge:
            peft_export.write_adapter(tmp, cfg, weights, files, torch_dtype, redact(str(source)))
        else:
            state = {n: t.to(torch_dtype).contiguous()
                     for n, t in to_hf_state_dict(weights, model_cfg.tie_embeddings, model_type).items()}
            _write_shards(tmp, state, shard_bytes)
            hf = hf_config_from_model(model_cfg, dtype_name, eos_id, bos_id)
            hf["dtype"] = dtype_name
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            generation = {"_from_model_config": False, "bos_token_id": bos_id, "eos_token_id": eos_id}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        write_lineage(tmp, record_export(out, found.run_dir, str(source), found.step, dtype))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as e:  # a full disk, no permission: nothing half-written is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise os_error(e, f"writing {out}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_model(source: str, endpoint_url: str | None = None) -> ModelSource:
    """The model of a run directory (its newest committed checkpoint, else its final weights),
    a checkpoint root or one step-NNNNNN checkpoint (local or a URL), the weights checked
    against the config."""
    if not is_url(source) and not Path(source).exists():
        raise KilnError(f"{source} does not exist; export-hf takes a run directory (runs/NAME), "
                        "a checkpoint root or one step-NNNNNN checkpoint")
    run_config = Path(source) / "config.yaml"
    run_dir = None
    if not is_url(source) and run_config.is_file():
        run_dir = Path(source)
        cfg = read_job(_text(run_config), str(run_config))
        root = cfg.checkpoint.dir or str(Path(source) / "checkpoints")
        found = find_checkpoint(root, endpoint_url or cfg.checkpoint.endpoint_url)
        if found is None:  # a run without checkpoints: its final weights
            weights_file = Path(source) / "model.safetensors"
            if not weights_file.is_file():
                raise KilnError(f"{source} has no committed checkpoint and no model.safetensors")
            files = {n: _text(Path(source) / n) for n in RUN_FILES
                     if (Path(source) / n).is_file()}
            try:
                weights = load_file(weights_file)
            except (SafetensorError, OSError) as e:
                raise unreadable(weights_file, e) from None
            _check_weights(cfg, weights, str(weights_file), str(run_config))
            return ModelSource(cfg.model, weights, files, None, run_dir, cfg)
    else:
        found = find_checkpoint(source, endpoint_url)
        if found is None:
            raise KilnError(f"{redact(source)} holds no committed checkpoint (step-NNNNNN "
                            "directories with a COMMITTED.json)")
        if not is_url(source):  # <run>/checkpoints[/step-N]: the run it belongs to
            root = Path(source).resolve()
            root = root.parent if root.name.startswith("step-") else root
            run_dir = root.parent if (root.parent / "config.yaml").is_file() else None
    committed, storage = found
    text = storage.read_text(committed.step, JOB_FILE)
    if text is None:
        raise KilnError(f"checkpoint {redact(committed.url)} has no {JOB_FILE}: cannot tell its model shape")
    job_where = f"{redact(committed.url)}/{JOB_FILE}"
    cfg = read_job(text, job_where)
    storage.verify(committed)  # a damaged file is named here, not met as a torch error later
    files = {n: t for n in RUN_FILES if (t := storage.read_text(committed.step, n)) is not None}
    reader = reader_for(committed.url, storage.options)
    meta = reader.read_metadata().state_dict_metadata
    weights = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in meta.items() if k.startswith("model.")}
    _check_weights(cfg, weights, redact(committed.url), job_where)
    state = {"model": weights}
    dcp.load(state, storage_reader=reader_for(committed.url, storage.options), no_dist=True)
    return ModelSource(cfg.model, state["model"], files, committed.step, run_dir, cfg)


def _check_weights(cfg: JobConfig, weights: dict, where: str, config_where: str) -> None:
    """KilnError unless the weights are exactly what cfg builds and trains: names and shapes
    (an adapter run's: its adapter's)."""
    from kiln.models.transformer import Transformer
    from kiln.peft import apply_tuning

    with torch.device("meta"):
        model = apply_tuning(Transformer(cfg.model), cfg)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in frozen}
    problems = shape_problems(expected, {n: tuple(t.shape) for n, t in weights.items()})
    if problems:
        raise KilnError(f"the weights in {where} do not fit the model {config_where} describes "
                        f"({'; '.join(problems)}); the config was changed after these weights "
                        "were saved. Export a checkpoint whose job.yaml matches, or restore the "
                        "run's config")


def _text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise os_error(e, f"reading {path}") from None
    except UnicodeDecodeError:
        raise KilnError(f"{path} is not UTF-8 text") from None


def read_job(text: str, where: str) -> JobConfig:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KilnError(f"{where} is not valid YAML ({getattr(e, 'problem', None) or e}); "
                        "it is the run's resolved config, written by kiln train") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model", {}), dict):
        raise KilnError(f"{where} is not a job config (a mapping of sections with a model: "
                        "section); it is the run's resolved config, written by kiln train")
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
