"""Writing outputs without losing what a user had: nothing is replaced without an explicit
flag, and every file is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError, os_error


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """`data` to `path` via a temporary file in the same directory, renamed when complete."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise os_error(e, f"writing {path}") from None


def refuse_overwrite(path: str | Path, force: bool, flag: str = "--force") -> None:
    """KilnError if `path` exists (and `force` is not given); always if it is a directory."""
    path = Path(path)
    if path.is_dir():
        raise KilnError(f"{path} is a directory; name the file to write")
    if path.exists() and not force:
        raise KilnError(f"{path} already exists; pass {flag} to replace it, or choose another name")


def check_output_dir(path: str | Path, option: str = "--out") -> Path:
    """The resolved path of an output directory, refused if it is a file or holds the current
    directory (replacing it would pull the ground from under the shell that ran us)."""
    resolved = Path(path).resolve()
    if resolved.exists() and not resolved.is_dir():
        raise KilnError(f"{option} {path}: a file of that name exists; an output directory "
                        "is needed here")
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise KilnError(f"{option} {path} is the current directory or holds it; name a new "
                        "subdirectory for the output instead")
    return resolved
