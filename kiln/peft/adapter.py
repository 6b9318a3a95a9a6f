"""What an adapter run records about itself (`adapter.json`: method, rank, task, the base and
its fingerprint), the refusal to put an adapter on another base, and `kiln adapters DIR`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kiln.config import JobConfig
from kiln.errors import KilnError

ADAPTER_FILE = "adapter.json"
"""In an adapter run's directory and in each of its checkpoints."""
EXPORTED_FILE = "kiln-adapter.json"
"""The same record in an exported PEFT adapter directory (PEFT's own adapter_config.json has
no field for the base's fingerprint)."""


def short(fingerprint: str) -> str:
    """A fingerprint's first 12 hex digits (with its kind unless sha256), for messages."""
    kind, _, digits = fingerprint.partition(":")
    return digits[:12] if kind == "sha256" else f"{kind}:{digits[:12]}"


@dataclass
class AdapterInfo:
    method: str
    rank: int
    alpha: float
    rslora: bool
    target_modules: list[str]
    base: str | None
    """model.init_from, or None for a base that is the seeded initialisation."""
    base_fingerprint: str
    task: str
    trainable_parameters: int

    @classmethod
    def of(cls, cfg: JobConfig, fingerprint: str, task: str, trainable: int) -> AdapterInfo:
        p = cfg.peft
        return cls(p.method, p.rank, p.alpha, p.rslora, list(p.target_modules), cfg.model.init_from,
                   fingerprint, task, trainable)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> AdapterInfo:
        try:
            raw = json.loads(text)
            return cls(**{f.name: raw[f.name] for f in fields(cls)})
        except (ValueError, KeyError, TypeError) as e:
            raise KilnError(f"{where} is not an adapter record kiln can read ({e})") from None

    def write(self, directory: Path, name: str = ADAPTER_FILE) -> None:
        tmp = directory / f".{name}.tmp"
        tmp.write_text(self.to_json())
        tmp.replace(directory / name)


def check_base(adapter: AdapterInfo, fingerprint: str, base: str | None, where: str) -> None:
    """KilnError unless the adapter recorded in `where` was trained on the base `fingerprint`."""
    if adapter.base_fingerprint == fingerprint:
        return
    raise KilnError(
        f"{where} holds an adapter trained on base {adapter.base or '(seeded initialisation)'} "
        f"with fingerprint {short(adapter.base_fingerprint)}, but the base here, "
        f"{base or '(seeded initialisation)'}, has fingerprint {short(fingerprint)}: an adapter "
        "only fits the weights it was trained on. Point model.init_from at the base it was "
        "trained on, or train a new adapter (another run name) for this base")


def find_adapters(root: str | Path) -> list[tuple[Path, AdapterInfo, int]]:
    """(directory, record, size in bytes) of the adapter runs and exported adapters under root."""
    root = Path(root)
    if not root.is_dir():
        raise KilnError(f"{root} is not a directory")
    found = []
    for name in (ADAPTER_FILE, EXPORTED_FILE):
        for record in sorted(root.rglob(name)):
            if "checkpoints" in record.relative_to(root).parts:
                continue  # the copies in each checkpoint of a run
            info = AdapterInfo.from_json(record.read_text(), str(record))
            weights = record.parent / "adapter_model.safetensors"
            size = weights.stat().st_size if weights.is_file() else 4 * info.trainable_parameters
            found.append((record.parent, info, size))
    return found


def adapters_table(root: str | Path) -> str:
    """`kiln adapters DIR`: one line per adapter, grouped by base fingerprint."""
    rows = find_adapters(root)
    if not rows:
        return f"no adapters under {root} (adapter runs hold {ADAPTER_FILE}; exports {EXPORTED_FILE})"
    rows.sort(key=lambda r: (r[1].base_fingerprint, str(r[0])))
    header = ("adapter", "method", "rank", "task", "size", "base fingerprint", "base")
    lines = [header] + [(str(path), info.method, str(info.rank), info.task, _size(size),
                         short(info.base_fingerprint), info.base or "(seeded initialisation)")
                        for path, info, size in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def record_run(cfg: JobConfig, run_dir: Path, trainable: int, task: str,
               resumed_files: dict[str, str] | None, resumed_from: str, write: bool) -> AdapterInfo | None:
    """An adapter run's record: refuses a checkpoint trained on another base, then (with
    write, on rank 0) writes run_dir/adapter.json, which every checkpoint then carries."""
    if cfg.peft.method == "full":
        return None
    from kiln.peft.fingerprint import base_fingerprint

    info = AdapterInfo.of(cfg, base_fingerprint(cfg), task, trainable)
    saved = (resumed_files or {}).get(ADAPTER_FILE)
    if saved is not None:
        where = f"checkpoint {resumed_from}"
        check_base(AdapterInfo.from_json(saved, where), info.base_fingerprint, cfg.model.init_from, where)
    if write:
        info.write(Path(run_dir))
    return info
