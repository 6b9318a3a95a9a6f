"""The quickstart corpus: the Python standard library's own source files, found at run time.

Real text on every machine with Python, nothing downloaded. Tests and vendored packages are
left out; the validation split is by file, chosen by a hash of its path so it never moves.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    train: list[str]
    val: list[str]
    fingerprint: str
    """sha256 over file names and contents: what the tokenizer cache is keyed on."""


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1]))
    if not files:
        raise KilnError(f"no Python source files found under the standard library at {root}")
    return files


@dataclass
class Module:
    name: str
    """Path relative to the standard library root, e.g. json/decoder.py."""
    text: str
    held_out: bool
    """In the validation split: chosen by a hash of the name, so it never moves."""


def stdlib_modules(val_fraction: float, max_bytes: int | None = None) -> tuple[list[Module], str]:
    """The non-empty stdlib source files in order, each marked held out or not, and a sha256
    over their names and contents."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules, total = [], 0
    digest = hashlib.sha256()
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        name = path.relative_to(root).as_posix()
        digest.update(name.encode() + b"\0" + text.encode())
        bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") / 2**32
        modules.append(Module(name, text, bucket < val_fraction))
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return modules, digest.hexdigest()


def load_stdlib_corpus(val_fraction: float, max_bytes: int | None = None) -> Corpus:
    modules, fingerprint = stdlib_modules(val_fraction, max_bytes)
    train = [m.text for m in modules if not m.held_out]
    val = [m.text for m in modules if m.held_out]
    if not train or not val:
        root = sysconfig.get_paths()["stdlib"]
        raise KilnError(f"the standard library corpus at {root} is too small to split "
                        f"({len(train)} train and {len(val)} validation files; "
                        f"data.val_fraction={val_fraction}, data.max_bytes={max_bytes})")
    return Corpus(train, val, fingerprint)
