"""What produced a model: lineage.json in every run directory and every Hugging Face export.

A run's lineage holds the config hash, the code version, the data it read (manifest hashes,
tokenizer fingerprint), the parent it started from (with the parent's own lineage when that is
a kiln run or export), and the checkpoints and exports it produced. `chain()` walks from a run
or export back to the first model.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import kiln
from kiln.urls import is_url, redact
from kiln.config import JobConfig
from kiln.errors import KilnError

LINEAGE_FILE = "lineage.json"
# Where and how a run is logged does not change what it produces.
_NOT_HASHED = ("name", "out_dir", "tracking")


def config_hash(cfg: JobConfig) -> str:
    """sha256 of the resolved config, less its name, directory and tracking settings."""
    raw = cfg.model_dump(mode="json", by_alias=True, exclude=set(_NOT_HASHED))
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def code_version() -> dict:
    """The git commit and dirty flag when kiln runs from a checkout, else the package version."""
    root = Path(kiln.__file__).resolve().parents[1]
    out: dict = {"kiln_version": kiln.__version__}
    if (root / ".git").exists():  # a directory in a clone, a file in a worktree
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                     "--untracked-files=no"], check=True, capture_output=True,
                                    text=True, timeout=10).stdout
            return {**out, "git_commit": commit, "git_dirty": bool(status.strip())}
        except (OSError, subprocess.SubprocessError):
            pass
    return {**out, "source": "package"}


def system_facts(world_size: int = 1) -> dict:
    """Versions and devices: what a run's numbers depend on besides its config and data."""
    import torch

    if torch.cuda.is_available():
        devices = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    else:
        devices = [platform.processor() or platform.machine() or "cpu"]
    return {"kiln": kiln.__version__, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "rocm": getattr(torch.version, "hip", None) or "none",
            "devices": ", ".join(devices), "device_count": max(torch.cuda.device_count(), 1)
            if torch.cuda.is_available() else 1, "world_size": world_size}


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def data_inputs(cfg: JobConfig, run_dir: Path) -> list[dict]:
    """Each prepared data directory the run reads: its manifest's sha256 and tokenizer."""
    if cfg.data.source == "stdlib":
        named = [("stdlib", str(run_dir / "data" / "stdlib-train"), "train"),
                 ("stdlib:val", str(run_dir / "data" / "stdlib-val"), "train")]
    else:
        named = [(s.name, s.path, s.split) for s in cfg.data.sources]
        named += [(f"val:{v.name}", v.path, v.split) for v in cfg.data.val]
    inputs = []
    for name, path, split in named:
        manifest = Path(path) / "manifest.json"
        entry: dict = {"name": name, "path": str(Path(path).resolve()), "split": split}
        if manifest.is_file():
            facts = json.loads(manifest.read_text())
            entry.update(manifest_sha256=_sha256_file(manifest),
                         tokenizer_fingerprint=facts.get("tokenizer", {}).get("fingerprint"),
                         tokens=facts.get("splits", {}).get(split, {}).get("tokens"))
        inputs.append(entry)
    return inputs


def read_lineage(path: str | Path) -> dict | None:
    """lineage.json of a run directory or an export; None when there is none."""
    file = Path(path) / LINEAGE_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def write_lineage(directory: str | Path, lineage: dict) -> None:
    file = Path(directory) / LINEAGE_FILE
    tmp = file.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(lineage, indent=2) + "\n")
    tmp.replace(file)


def parent_of(cfg: JobConfig, run_dir: Path, resumed_from: str | None) -> dict | None:
    """The model the run started from: model.init_from, or a checkpoint of another run."""
    if cfg.model.init_from:
        path = Path(cfg.model.init_from).resolve()
        lineage = read_lineage(path)
        config = path / "config.json"
        return {"kind": "kiln-export" if lineage else "hf-model", "path": str(path),
                "config_sha256": _sha256_file(config) if config.is_file() else None,
                "lineage": lineage}
    own_root = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    if resumed_from and not _under(resumed_from, own_root):
        parent: dict = {"kind": "kiln-checkpoint", "path": redact(resumed_from), "lineage": None}
        if not is_url(resumed_from):  # <run>/checkpoints/step-N: the run that wrote it
            parent["lineage"] = read_lineage(Path(resumed_from).resolve().parents[1])
        return parent
    return None


def _under(path: str, root: str) -> bool:
    if is_url(path) or is_url(root):
        return str(path).startswith(str(root).rstrip("/") + "/")
    return Path(root).resolve() in Path(path).resolve().parents


def run_lineage(cfg: JobConfig, run_dir: Path, resumed_from: str | None = None) -> dict:
    """The lineage of a run starting or resuming now, keeping what an earlier session recorded."""
    run_dir = Path(run_dir)
    old = read_lineage(run_dir) if resumed_from else None
    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    lineage = {
        "kind": "kiln-run", "name": cfg.name, "path": str(run_dir.resolve()),
        "created": (old or {}).get("created", now),
        "config_hash": config_hash(cfg), "code": code_version(),
        "data": data_inputs(cfg, run_dir),
        "tokenizer_fingerprint": _tokenizer_fingerprint(run_dir, cfg),
        "parent": (old or {}).get("parent") if resumed_from and (old or {}).get("parent")
        else parent_of(cfg, run_dir, resumed_from),
        "resumed_from": [*(old or {}).get("resumed_from", []),
                         *([redact(resumed_from)] if resumed_from else [])],
        "checkpoints": (old or {}).get("checkpoints", []),
        "exports": (old or {}).get("exports", []),
    }
    return lineage


def _tokenizer_fingerprint(run_dir: Path, cfg: JobConfig) -> str | None:
    tokenizer = run_dir / "tokenizer.json"
    if tokenizer.is_file():
        from tokenizers import Tokenizer

        from kiln.data.tokenizer import fingerprint

        return fingerprint(Tokenizer.from_file(str(tokenizer)))
    return None


def record_checkpoints(cfg: JobConfig, run_dir: Path) -> None:
    """Add the run's committed checkpoints to its lineage ("kept": still there after retention)."""
    from kiln.checkpoint.storage import Storage

    lineage = read_lineage(run_dir)
    if lineage is None or not cfg.checkpoint.enabled:
        return
    storage = Storage(cfg.checkpoint.dir or str(Path(run_dir) / "checkpoints"),
                      cfg.checkpoint.endpoint_url)
    present = {c.step: redact(c.url) for c in storage.committed()}
    known = {c["step"]: c for c in lineage.get("checkpoints", [])}
    for step, url in present.items():
        known[step] = {"step": step, "url": url}
    for step, entry in known.items():
        entry["kept"] = step in present
    lineage["checkpoints"] = [known[s] for s in sorted(known)]
    write_lineage(run_dir, lineage)


def record_export(out: Path, run_dir: Path | None, source: str, step: int | None,
                  dtype: str) -> dict:
    """lineage.json for a Hugging Face export, and the export added to its run's lineage."""
    run = read_lineage(run_dir) if run_dir is not None else None
    export = {"kind": "kiln-export", "path": str(Path(out).resolve()), "source": redact(source),
              "step": step, "dtype": dtype, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "code": code_version(), "run": run}
    if run is not None and run_dir is not None:
        entry = {k: export[k] for k in ("path", "step", "dtype", "created")}
        run["exports"] = [*run.get("exports", []), entry]
        write_lineage(run_dir, run)
    return export


def chain(path: str | Path) -> list[dict]:
    """The lineage of `path` and each ancestor's, newest first (a run, its export, ...)."""
    node = read_lineage(path)
    if node is None:
        config = Path(path) / "config.json"
        return [{"kind": "hf-model", "path": str(Path(path).resolve())}] if config.is_file() else []
    out = []
    while node is not None:
        out.append(node)
        if node.get("kind") == "kiln-export":
            node = node.get("run")
        else:
            parent = node.get("parent")
            if parent is None:
                break
            node = parent.get("lineage") or {k: v for k, v in parent.items() if k != "lineage"}
            if node.get("kind") in ("hf-model", "kiln-checkpoint") and not parent.get("lineage"):
                out.append(node)
                break
    return out


def describe_chain(path: str | Path) -> str:
    """A few lines, one per generation: what `kiln lineage` prints."""
    nodes = chain(path)
    if not nodes:
        raise KilnError(f"{path} holds no lineage.json and no config.json: not a kiln run, a "
                        "kiln export or a Hugging Face model directory")
    lines = []
    for depth, n in enumerate(nodes):
        pad = "  " * depth + ("<- " if depth else "")
        kind = n.get("kind")
        if kind == "kiln-run":
            code = n.get("code", {})
            version = (f"git {code['git_commit'][:10]}{' (dirty)' if code.get('git_dirty') else ''}"
                       if "git_commit" in code else f"kiln {code.get('kiln_version')}")
            data = ", ".join(f"{d['name']} {str(d.get('manifest_sha256'))[:10]}"
                             for d in n.get("data", []))
            kept = [c["step"] for c in n.get("checkpoints", []) if c.get("kept")]
            lines.append(f"{pad}run {n.get('name')} ({n.get('path')}): config {n['config_hash'][:12]}, "
                         f"{version}, data [{data}], tokenizer "
                         f"{str(n.get('tokenizer_fingerprint'))[:12]}, checkpoints {kept or 'none'}, "
                         f"exports {len(n.get('exports', []))}")
        elif kind == "kiln-export":
            lines.append(f"{pad}export {n.get('path')} (step {n.get('step')}, {n.get('dtype')}) "
                         f"from {n.get('source')}")
        else:
            lines.append(f"{pad}{kind} {n.get('path')}")
    return "\n".join(lines)


def lineage_tags(lineage: dict, prefix: str = "kiln.") -> dict[str, str]:
    """The same facts as flat MLflow tags."""
    code = lineage.get("code", {})
    tags = {"config_hash": lineage.get("config_hash"), "kiln_version": code.get("kiln_version"),
            "git_commit": code.get("git_commit"), "git_dirty": code.get("git_dirty"),
            "tokenizer_fingerprint": lineage.get("tokenizer_fingerprint")}
    for d in lineage.get("data", []):
        tags[f"data.{d['name']}.manifest_sha256"] = d.get("manifest_sha256")
    parent = lineage.get("parent")
    if parent:
        tags["parent.kind"], tags["parent.path"] = parent.get("kind"), parent.get("path")
        ancestors = chain_names(parent)
        if ancestors:
            tags["parent.run"] = ancestors[0]
    if lineage.get("resumed_from"):
        tags["resumed_from"] = lineage["resumed_from"][-1]
    return {f"{prefix}{k}": str(v) for k, v in tags.items() if v is not None}


def chain_names(parent: dict) -> list[str]:
    """Names of the kiln runs above a parent entry, nearest first."""
    names, node = [], parent.get("lineage")
    while node is not None:
        if node.get("kind") == "kiln-export":
            node = node.get("run")
            continue
        names.append(node.get("name"))
        node = (node.get("parent") or {}).get("lineage")
    return names


def environment_has_secret(value: str) -> bool:
    """Whether a string carries any MLflow credential from the environment (never to be logged)."""
    secrets = [os.environ.get(k) for k in ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD")]
    return any(s and s in value for s in secrets)
