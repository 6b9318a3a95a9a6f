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
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kiln.errors import PERMANENT, KilnError, full_disk_in, os_error
from kiln.urls import is_url, redact, scrub_credentials

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
    """fn(), retried with exponential backoff on I/O errors that may pass (not a missing file,
    a full disk, a permission)."""
    for attempt in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as e:
            if attempt == attempts - 1 or e.errno in PERMANENT:
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
        if redact(self.root) != self.root:
            raise KilnError(f"{redact(self.root)}: credentials in a URL (user:secret@) are not "
                            "used, and would end up in logs; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY in the environment instead")
        self.options = storage_options(self.root, endpoint_url)
        self.local = not is_url(self.root)
        self.skipped: dict[str, str] = {}
        """Why each step directory the last committed() saw was not taken, by URL."""
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
        """Every step with a valid commit marker whose files are all there, oldest first; why
        each other step directory is not taken goes to `self.skipped`."""
        self.fs.invalidate_cache()
        try:
            entries = retry(lambda: self.fs.ls(self.path, detail=True))
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, "listing") from None
        steps, self.skipped = [], {}
        for entry in entries:
            m = _STEP_DIR.match(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if m and entry.get("type") == "directory":
                committed, reason = self.check(int(m.group(1)))
                if committed is not None:
                    steps.append(committed)
                else:
                    self.skipped[self.step_url(int(m.group(1)))] = reason
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
        return self.check(step)[0]

    def check(self, step: int) -> tuple[Committed | None, str | None]:
        """(the committed step, None), or (None, why it does not count)."""
        path = self._step_path(step)
        try:
            raw = retry(lambda: self.fs.cat_file(f"{path}/{MARKER}"))
        except FileNotFoundError:
            return None, f"it has no {MARKER} (a save that did not finish)"
        except OSError as e:
            return None, f"its {MARKER} cannot be read ({e.strerror or e})"
        try:
            marker = json.loads(raw)
        except ValueError:
            return None, f"its {MARKER} is not valid JSON"
        problem = _marker_problem(marker, step)
        if problem:
            return None, f"its {MARKER} {problem}"
        try:
            sizes = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["size"]
                     for e in retry(lambda: self.fs.ls(path, detail=True))}
        except OSError as e:
            return None, f"it cannot be listed ({e.strerror or e})"
        for name, meta in marker["files"].items():
            if name not in sizes:
                return None, f"{name}, listed in its {MARKER}, is missing"
            if sizes[name] != meta["size"]:
                return None, (f"{name} has {sizes[name]} bytes where its {MARKER} says "
                              f"{meta['size']} (truncated or changed)")
        return Committed(step, self.step_url(step), marker), None

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
        try:
            if retry(lambda: self.fs.exists(path)):
                self.delete(step)
            if self.local:
                Path(path).mkdir(parents=True, exist_ok=True)
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, f"saving step {step}") from None
        return self.step_url(step)

    def write_text(self, step: int, name: str, text: str) -> None:
        try:
            self._put(f"{self._step_path(step)}/{name}", text.encode())
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, f"saving step {step}") from None

    def _put(self, path: str, data: bytes) -> None:
        if self.local:  # write then rename, so no reader sees half a file
            tmp = Path(path + ".tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(path)
            except OSError:
                tmp.unlink(missing_ok=True)
                raise
        else:  # an object PUT is atomic: it appears whole or not at all
            retry(lambda: self.fs.pipe_file(path, data))

    def describe_files(self, step: int, prefix: str = "", exclude_prefix: str | None = None) -> dict:
        """{name: {size, sha256}} of the step's files whose names start with prefix."""
        path = self._step_path(step)
        try:
            self.fs.invalidate_cache()
            entries = retry(lambda: self.fs.ls(path, detail=True))
            files = {}
            for e in entries:
                name = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if (name == MARKER or name.endswith(".tmp") or e.get("type") != "file"
                        or not name.startswith(prefix)
                        or (exclude_prefix and name.startswith(exclude_prefix))):
                    continue
                files[name] = {"size": e["size"],
                               "sha256": retry(lambda: self._sha256(e["name"]))}
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, f"hashing the files of step {step}") from None
        return files

    def commit(self, step: int, extra: dict, files: dict | None = None) -> Committed:
        """Write the marker, last: the files (as describe_files gives them; default: hash
        everything in the step's directory) plus `extra`."""
        path = self._step_path(step)
        if files is None:
            files = self.describe_files(step)
        marker = {"step": step, "files": files, "time": time.time(), **extra}
        try:
            self._put(f"{path}/{MARKER}", json.dumps(marker, indent=1).encode())
            if self.local:
                _fsync_dir(path)
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, f"committing step {step}") from None
        return Committed(step, self.step_url(step), marker)

    # -- failures ----------------------------------------------------------------------------

    def probe(self) -> None:
        """Check, before training, that checkpoints can be written here; KilnError if not.

        An object store gets a small probe object, written and deleted (reachability, bucket,
        credentials, write permission), with few retries so an unreachable endpoint is said in
        seconds; a local root needs its nearest existing directory to be writable (nothing is
        created)."""
        if self.local:
            path = Path(self.path).absolute()
            existing = next(p for p in (path, *path.parents) if p.exists())
            if not existing.is_dir():
                raise KilnError(f"checkpoint.dir {self}: {existing} is a file, not a directory")
            if not os.access(existing, os.W_OK | os.X_OK):
                raise KilnError(f"checkpoint.dir {self}: {existing} is not writable")
            return
        import fsspec  # noqa: PLC0415

        options = {**self.options, "skip_instance_cache": True,
                   "config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"},
                                     "connect_timeout": 5, "read_timeout": 10}}
        probe = f"{self.path}/.kiln-probe-{uuid.uuid4().hex[:12]}"
        try:
            fs, _ = fsspec.core.url_to_fs(self.root, **options)
            fs.pipe_file(probe, b"kiln checks that checkpoints can be written here\n")
            fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 (botocore raises its own types)
            raise self._failed(e, "writing a probe object") from None

    def save_error(self, error: BaseException, step: int) -> BaseException:
        """What to raise when writing a step failed: a KilnError when a user can fix the cause
        (a full disk, an unreachable store, no permission), else `error` itself.

        DCP's writer loses the errno of a full disk ("unexpected pos 704 vs 598"), so a local
        root is also called full when its device is left with less than 1 MiB (1% of a small
        one) after the failure: the partly written file is still there, filling it."""
        if isinstance(error, KilnError):
            return error
        full = full_disk_in(error)
        if full is None and self.local:
            try:
                usage = shutil.disk_usage(self._existing_local())
                if usage.free < min(1 << 20, usage.total // 100):
                    full = OSError(28, "No space left on device")
            except OSError:
                pass
        if full is not None:
            return KilnError(f"checkpoint.dir {self}: no space left on the device while saving "
                             f"step {step}; the checkpoints before it are intact (a partial "
                             f"step-{step:06d} may remain and is removed by the next save). "
                             "Free some space or point checkpoint.dir elsewhere, then resume")
        if not self.local or isinstance(error, OSError):
            return self._failed(error, f"saving step {step}")
        return error

    def _existing_local(self) -> Path:
        path = Path(self.path).absolute()
        return next(p for p in (path, *path.parents) if p.exists())

    def _failed(self, error: BaseException, doing: str) -> KilnError:
        """One paragraph for a failed storage operation, naming the root and the cause."""
        if isinstance(error, KilnError):
            return error
        if self.local and isinstance(error, OSError):
            return os_error(error, f"checkpoint.dir {self}, {doing}")
        endpoint = self.options.get("client_kwargs", {}).get("endpoint_url", "AWS's default")
        bucket = self.path.split("/", 1)[0]
        names = {c.__name__ for c in type(error).__mro__}
        if isinstance(error, FileNotFoundError) or "NoSuchBucket" in str(error.__cause__):
            why = (f"the bucket {bucket!r} does not exist at endpoint {endpoint} (create it, or "
                   "check the name and checkpoint.endpoint_url)")
        elif isinstance(error, PermissionError):
            why = ("access denied: check the credentials in AWS_ACCESS_KEY_ID / "
                   "AWS_SECRET_ACCESS_KEY and that they may write to this bucket")
        elif names & {"EndpointConnectionError", "ConnectTimeoutError", "ConnectionError",
                      "ReadTimeoutError", "ClientConnectorError"}:
            why = (f"cannot connect to the endpoint {endpoint} (is it running and reachable? set "
                   "checkpoint.endpoint_url or AWS_ENDPOINT_URL)")
        elif "NoCredentialsError" in names:
            why = "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        elif full_disk_in(error) is not None:
            why = "no space left on the device"
        else:
            why = f"{type(error).__name__}: {error}"
        return KilnError(scrub_credentials(f"checkpoint.dir {self}, {doing}: {why}"))

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


def _marker_problem(marker, step: int) -> str | None:
    """What is wrong with a parsed commit marker, or None."""
    if not isinstance(marker, dict):
        return f"is a JSON {type(marker).__name__}, not an object"
    if marker.get("step") != step:
        return f"is for step {marker.get('step')!r}, not {step}"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files"
    for name, meta in files.items():
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int)
                and isinstance(meta.get("sha256"), str)):
            return f"lists {name} without a size and sha256"
    return None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
