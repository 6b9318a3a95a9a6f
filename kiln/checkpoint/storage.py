"""Where checkpoints live: a local path, an NFS mount or an object store (s3://), via fsspec.

Layout: <root>/step-000100/ holds the DCP files plus COMMITTED.json, written last, which lists
every file with its size and sha256. A step without a valid marker (a crash mid-save, a torn
upload) does not exist as far as readers are concerned.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kiln.errors import KilnError
from kiln.urls import is_url, redact

MARKER = "COMMITTED.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
T = TypeVar("T")


def storage_options(url: str, endpoint_url: str | None) -> dict:
    """fsspec options for an object-store URL; credentials come from the environment only."""
    if not url.startswith(("s3://", "s3a://")):
        return {}
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    # botocore retries throttling and 5xx answers (a busy or flaky store) with backoff.
    options: dict = {"config_kwargs": {"retries": {"max_attempts": 10, "mode": "standard"}}}
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return options


def retry(fn: Callable[[], T], attempts: int = 5, delay: float = 0.2) -> T:
    """fn(), retried with exponential backoff on I/O errors other than a missing file."""
    for attempt in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError:
            if attempt == attempts - 1:
                raise
            time.sleep(delay * 2**attempt)
    raise AssertionError("unreachable")


@dataclass
class Committed:
    step: int
    url: str
    """Where the step's files are: a local path or a URL, as DCP readers take it."""
    marker: dict


class Storage:
    """A checkpoint root directory on any fsspec filesystem."""

    def __init__(self, root: str, endpoint_url: str | None = None):
        import fsspec  # noqa: PLC0415 (kept off the import path of `kiln config`)

        self.root = str(root).rstrip("/")
        self.options = storage_options(self.root, endpoint_url)
        self.local = not is_url(self.root)
        try:
            self.fs, self.path = fsspec.core.url_to_fs(self.root, **self.options)
        except (ImportError, ValueError) as e:
            raise KilnError(f"checkpoint.dir {redact(self.root)}: cannot open it ({e}); for s3:// "
                            "install s3fs") from None

    def __str__(self) -> str:
        return redact(self.root)

    def step_url(self, step: int) -> str:
        return f"{self.root}/step-{step:06d}"

    def _step_path(self, step: int) -> str:
        return f"{self.path}/step-{step:06d}"

    # -- reading -----------------------------------------------------------------------------

    def committed(self) -> list[Committed]:
        """Every step with a valid commit marker whose files are all there, oldest first."""
        self.fs.invalidate_cache()
        try:
            entries = retry(lambda: self.fs.ls(self.path, detail=True))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise KilnError(f"cannot list checkpoint.dir {self}: {e}") from None
        steps = []
        for entry in entries:
            m = _STEP_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if m and entry.get("type") == "directory":
                committed = self.read(int(m.group(1)))
                if committed is not None:
                    steps.append(committed)
        return sorted(steps, key=lambda c: c.step)

    def uncommitted_steps(self) -> list[int]:
        """Step directories without a valid marker: torn or in-flight saves."""
        self.fs.invalidate_cache()
        try:
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
        steps = [int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))]
        return [s for s in steps if self.read(s) is None]

    def read(self, step: int) -> Committed | None:
        """The step if its marker is valid and every listed file has its listed size."""
        path = self._step_path(step)
        try:
            marker = json.loads(retry(lambda: self.fs.cat_file(f"{path}/{MARKER}")))
            sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"]
                     for e in retry(lambda: self.fs.ls(path, detail=True))}
        except (OSError, ValueError):
            return None
        files = marker.get("files") if isinstance(marker, dict) else None
        if marker.get("step") != step or not isinstance(files, dict) or not files:
            return None
        if any(sizes.get(name) != meta.get("size") for name, meta in files.items()):
            return None
        return Committed(step, self.step_url(step), marker)

    def verify(self, committed: Committed) -> None:
        """Re-hash every file against the manifest; KilnError on the first mismatch."""
        path = self._step_path(committed.step)
        for name, meta in committed.marker["files"].items():
            digest = retry(lambda: self._sha256(f"{path}/{name}"))
            if digest != meta["sha256"]:
                raise KilnError(f"checkpoint {committed.url}: {name} does not match the checksum "
                                f"in its {MARKER} (the file changed or is corrupt)")

    def _sha256(self, path: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    def read_text(self, step: int, name: str) -> str | None:
        try:
            return retry(lambda: self.fs.cat_file(f"{self._step_path(step)}/{name}")).decode()
        except FileNotFoundError:
            return None

    # -- writing -----------------------------------------------------------------------------

    def prepare(self, step: int) -> str:
        """An empty directory for `step` (a torn one from an earlier crash is removed)."""
        path = self._step_path(step)
        if retry(lambda: self.fs.exists(path)):
            self.delete(step)
        if self.local:
            Path(path).mkdir(parents=True, exist_ok=True)
        return self.step_url(step)

    def write_text(self, step: int, name: str, text: str) -> None:
        self._put(f"{self._step_path(step)}/{name}", text.encode())

    def _put(self, path: str, data: bytes) -> None:
        if self.local:  # write then rename, so no reader sees half a file
            tmp = Path(path + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
        else:  # an object PUT is atomic: it appears whole or not at all
            retry(lambda: self.fs.pipe_file(path, data))

    def describe_files(self, step: int, prefix: str = "", exclude_prefix: str | None = None) -> dict:
        """{name: {size, sha256}} of the step's files whose names start with prefix."""
        path = self._step_path(step)
        self.fs.invalidate_cache()
        entries = retry(lambda: self.fs.ls(path, detail=True))
        files = {}
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if (name == MARKER or name.endswith(".tmp") or e.get("type") != "file"
                    or not name.startswith(prefix)
                    or (exclude_prefix and name.startswith(exclude_prefix))):
                continue
            files[name] = {"size": e["size"], "sha256": retry(lambda: self._sha256(e["name"]))}
        return files

    def commit(self, step: int, extra: dict, files: dict | None = None) -> Committed:
        """Write the marker, last: the files (as describe_files gives them; default: hash
        everything in the step's directory) plus `extra`."""
        path = self._step_path(step)
        if files is None:
            files = self.describe_files(step)
        marker = {"step": step, "files": files, "time": time.time(), **extra}
        self._put(f"{path}/{MARKER}", json.dumps(marker, indent=1).encode())
        if self.local:
            _fsync_dir(path)
        return Committed(step, self.step_url(step), marker)

    def delete(self, step: int) -> None:
        path = self._step_path(step)
        # The marker goes first, so a reader never sees a committed step with files missing.
        try:
            retry(lambda: self.fs.rm_file(f"{path}/{MARKER}"))
        except FileNotFoundError:
            pass
        try:
            retry(lambda: self.fs.rm(path, recursive=True))
        except FileNotFoundError:
            pass

    def apply_retention(self, newest: int, keep_last: int | None, keep_every: int | None,
                        keep: set[int] = frozenset()) -> list[int]:
        """Delete what is no longer kept, now that `newest` is committed; returns deleted steps.

        Kept: the newest `keep_last` committed steps, every multiple of `keep_every` and the
        steps in `keep` (the best checkpoint, kiln/tracking/best.py). Torn
        steps older than `newest` are removed too; nothing newer than `newest` is touched.
        """
        committed = [c.step for c in self.committed() if c.step <= newest]
        kept = set(committed[-keep_last:]) if keep_last else set(committed)
        kept |= {s for s in committed if keep_every and s % keep_every == 0}
        kept |= {newest, *keep}
        doomed = [s for s in committed if s not in kept]
        doomed += [s for s in self.uncommitted_steps() if s < newest]
        for step in doomed:
            self.delete(step)
        return sorted(doomed)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
