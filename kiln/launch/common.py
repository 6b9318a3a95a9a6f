"""What every launcher shares: the resolved job (YAML text any node can load) and the rule that
no credential ever goes into a manifest or a batch script."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kiln.config import JobConfig, load_config
from kiln.errors import KilnError
from kiln.urls import redact

# `scheme://user:secret@host`: a URL that carries credentials.
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@")
# AWS access key ids (long-term AKIA..., temporary ASIA...).
_AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")
# A key named like a credential (aws_secret_access_key, password, token; not max_tokens).
_SECRET_KEY = re.compile(r"(^|[._-])(secret|password|passwd|token|credentials?|api_?key)([._-]|$)"
                         r"|secret|access_key", re.I)


@dataclass
class ResolvedJob:
    config: JobConfig
    yaml: str
    """The fully resolved job, what `kiln.config.load_config` reads back into the same config."""


def resolve_job(path: str | Path, overrides: list[str], out_dir: str | None = None) -> ResolvedJob:
    """Load and validate the job with its --set overrides, refusing credentials; out_dir, when
    given, replaces a relative `out_dir` (the run directory must live on shared storage)."""
    for item in overrides:
        key, _, value = item.partition("=")
        if _SECRET_KEY.search(key.strip()) or _looks_secret(value):
            raise KilnError(
                f"--set {key.strip()}=...: this looks like a credential, and the job config is "
                f"written in clear into the manifest or batch script (and saved with the run); "
                f"keep credentials out of the config: on Kubernetes name a Secret with "
                f"--s3-secret, on Slurm export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in the "
                f"environment that submits the job")
    cfg = load_config(path, overrides)
    if out_dir is not None and not Path(cfg.out_dir).is_absolute():
        cfg = cfg.model_copy(update={"out_dir": str(Path(out_dir) / cfg.out_dir)})
    raw = cfg.model_dump(mode="json")
    for where, value in _strings(raw):
        if _looks_secret(value):
            raise KilnError(f"{path}: '{where}' holds a credential ({_redact(value)}); it would "
                            f"be written in clear into the launch files. Remove it: object-store "
                            f"credentials come from the environment (a Kubernetes Secret named "
                            f"with --s3-secret, or AWS_* variables on Slurm)")
    return ResolvedJob(cfg, yaml.safe_dump(raw, sort_keys=False))


def _looks_secret(value: str) -> bool:
    return bool(_URL_USERINFO.search(value) or _AWS_KEY_ID.search(value))


def _redact(value: str) -> str:
    return _AWS_KEY_ID.sub("<key id>", redact(value))


def _strings(node: Any, prefix: str = ""):
    """(dotted.key, value) for every string in a nested dict/list."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _strings(value, f"{prefix}.{i}")
    elif isinstance(node, str):
        yield prefix, node


def dns_name(text: str, limit: int = 40) -> str:
    """A Kubernetes/Slurm-safe name from a run name: lowercase letters, digits and '-'."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if not name or not name[0].isalpha():
        name = f"kiln-{name}".strip("-")
    return name[:limit].rstrip("-")
