"""Raw documents from text, JSONL and Parquet files, on local paths, globs or any fsspec URL.

Every problem a user can cause (a missing file, an empty one, a line that is not JSON, a
missing field or column) is a KilnError naming the file, and the line where there is one.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import KilnError
from kiln.urls import is_url, scrub_credentials

FORMATS = ("auto", "text", "jsonl", "parquet")
_SUFFIXES = {".txt": "text", ".text": "text", ".md": "text", ".py": "text",
             ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


@dataclass
class Document:
    text: str
    score: float | None = None
    """The difficulty score, when a score field/column was asked for."""


@dataclass
class InputFile:
    url: str
    """A local path or an fsspec URL (s3://bucket/key, gs://..., memory://...)."""
    size: int
    stamp: str
    """What changes when the file changes: mtime for local files, the ETag or mtime remotely."""


@dataclass
class ReadStats:
    documents: int = 0
    bad_records: int = 0
    bad_examples: list[str] = field(default_factory=list)
    invalid_utf8_bytes: int = 0
    """Bytes that are not UTF-8, each run replaced by U+FFFD; counted so a user hears of them."""
    invalid_utf8_files: list[str] = field(default_factory=list)


_replaced_bytes = 0


def _count_and_replace(error: UnicodeDecodeError) -> tuple[str, int]:
    """The "replace" error handler, counting what it replaces (read one file at a time)."""
    global _replaced_bytes
    _replaced_bytes += error.end - error.start
    return "\ufffd", error.end


_ERRORS = "kiln-count-replace"
codecs.register_error(_ERRORS, _count_and_replace)


def _known(name: str) -> bool:
    """A file a directory listing picks up: a known suffix, possibly compressed (a.jsonl.gz)."""
    return any(suffix in _SUFFIXES for suffix in Path(name).suffixes)


def _fs(url: str, storage_options: dict | None = None):
    import fsspec  # only when reading a URL: local files need nothing extra

    try:
        fs, _, _ = fsspec.get_fs_token_paths(url, storage_options=storage_options or {})
    except (ImportError, ValueError) as e:
        raise KilnError(f"cannot open {url}: {e} (install the fsspec backend for this scheme, "
                        f"e.g. s3fs for s3://)") from None
    return fs


def expand_inputs(patterns: list[str], storage_options: dict | None = None) -> list[InputFile]:
    """Each pattern (a file, a directory, a glob or a URL) to a sorted list of files."""
    if not patterns:
        raise KilnError("no input files given")
    files: list[InputFile] = []
    for pattern in patterns:
        found = (_expand_url(pattern, storage_options) if is_url(pattern)
                 else _expand_local(pattern.removeprefix("file://")))
        if not found:
            raise KilnError(f"input {pattern!r} matches no file")
        files.extend(found)
    return files


def _expand_local(pattern: str) -> list[InputFile]:
    if glob.has_magic(pattern):
        paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    elif Path(pattern).is_dir():
        paths = sorted(p for p in Path(pattern).rglob("*") if _known(p.name))
    elif Path(pattern).exists():
        paths = [Path(pattern)]
    else:
        raise KilnError(f"input file {pattern} does not exist")
    out = []
    for p in paths:
        if p.is_file():
            st = p.stat()
            out.append(InputFile(str(p.resolve()), st.st_size, str(st.st_mtime_ns)))
    return out


def _expand_url(pattern: str, storage_options: dict | None) -> list[InputFile]:
    if scrub_credentials(pattern) != pattern:
        raise KilnError(f"input {scrub_credentials(pattern)}: credentials in a URL (user:secret@) "
                        "are not used, and would end up in logs; set them in the environment "
                        "(AWS_ACCESS_KEY_ID, ...) or with --storage-option")
    fs = _fs(pattern, storage_options)
    protocol = pattern.split("://", 1)[0]
    try:
        if glob.has_magic(pattern):
            names = sorted(fs.glob(pattern))
        elif fs.isdir(pattern):
            names = sorted(n for n in fs.find(pattern) if _known(n))
        elif fs.exists(pattern):
            names = [pattern]
        else:
            raise KilnError(f"input {pattern} does not exist")
        out = []
        for name in names:
            url = name if "://" in name else f"{protocol}://{name}"
            info = fs.info(url)
            stamp = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
            out.append(InputFile(url, int(info.get("size") or 0), str(stamp)))
        return out
    except KilnError:
        raise
    except Exception as e:  # network, permissions, bucket missing: name the URL
        raise KilnError(f"cannot list input {pattern}: {type(e).__name__}: {e}") from None


def detect_format(url: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffixes = Path(url.split("?")[0]).suffixes
    for suffix in reversed(suffixes):
        if suffix in _SUFFIXES:
            return _SUFFIXES[suffix]
        if suffix not in (".gz", ".zst", ".bz2", ".xz"):
            break
    return "text"


def open_input(url: str, mode: str, storage_options: dict | None):
    """A file object; compressed files (.gz, .zst, ...) are decompressed on the fly."""
    kwargs = {"encoding": "utf-8", "errors": _ERRORS} if "t" in mode else {}
    if not is_url(url) and not any(url.endswith(s) for s in (".gz", ".bz2", ".xz", ".zst")):
        return open(url.removeprefix("file://"), mode, **kwargs)
    import fsspec

    return fsspec.open(url, mode, compression="infer", **(storage_options or {}), **kwargs).open()


def read_documents(file: InputFile, fmt: str = "auto", text_field: str = "text",
                   score_field: str | None = None, skip_bad_records: bool = False,
                   stats: ReadStats | None = None,
                   storage_options: dict | None = None) -> Iterator[Document]:
    """The documents of one file: a whole text file, one per JSONL line, one per Parquet row."""
    stats = stats if stats is not None else ReadStats()
    kind = detect_format(file.url, fmt)
    if file.size == 0:
        raise KilnError(f"input file {file.url} is empty")
    replaced_before = _replaced_bytes
    try:
        if kind == "text":
            with open_input(file.url, "rt", storage_options) as f:
                text = f.read()
            if not text.strip():
                raise KilnError(f"input file {file.url} holds only whitespace")
            stats.documents += 1
            yield Document(text)
        elif kind == "jsonl":
            yield from _read_jsonl(file.url, text_field, score_field, skip_bad_records, stats,
                                   storage_options)
        elif kind == "parquet":
            yield from _read_parquet(file.url, text_field, score_field, stats, storage_options)
        else:
            raise KilnError(f"unknown input format {fmt!r}; use one of {', '.join(FORMATS)}")
    except FileNotFoundError:
        raise KilnError(f"input file {file.url} does not exist (was it removed?)") from None
    except OSError as e:
        raise KilnError(f"cannot read {file.url}: {e.strerror or e}") from None
    replaced = _replaced_bytes - replaced_before
    if replaced:
        stats.invalid_utf8_bytes += replaced
        stats.invalid_utf8_files.append(file.url)


def bad_record(stats: ReadStats, skip: bool, message: str) -> None:
    if not skip:
        raise KilnError(message + " (pass --skip-bad-records to skip and count such records)")
    stats.bad_records += 1
    if len(stats.bad_examples) < 5:
        stats.bad_examples.append(message)


def jsonl_records(url: str, skip: bool, stats: ReadStats,
                  storage_options: dict | None) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line; a line that is not JSON stops with
    its line and column (or is skipped and counted)."""
    with open_input(url, "rt", storage_options) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                bad_record(stats, skip, f"{url}, line {lineno}, column {e.colno}: not valid JSON ({e.msg})")


def _read_jsonl(url: str, text_field: str, score_field: str | None, skip: bool,
                stats: ReadStats, storage_options: dict | None) -> Iterator[Document]:
    for lineno, record in jsonl_records(url, skip, stats, storage_options):
        if not isinstance(record, dict) or text_field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            bad_record(stats, skip, f"{url}, line {lineno}: no text field {text_field!r} "
                                    f"(the record has: {keys}); choose it with --field")
            continue
        text = record[text_field]
        if not isinstance(text, str):
            bad_record(stats, skip, f"{url}, line {lineno}: field {text_field!r} is a "
                                    f"{type(text).__name__}, not a string")
            continue
        text = _without_lone_surrogates(text)
        score = _score(record.get(score_field), url, f"line {lineno}", score_field)
        stats.documents += 1
        yield Document(text, score)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads already joined the valid pairs


def _without_lone_surrogates(text: str) -> str:
    """JSON may escape half a UTF-16 pair ("\\ud800"), which no tokenizer takes: each becomes
    U+FFFD and is counted with the invalid UTF-8 bytes."""
    global _replaced_bytes
    fixed, count = _LONE_SURROGATE.subn("\ufffd", text)
    _replaced_bytes += count
    return fixed


def _score(value, url: str, where: str, score_field: str | None) -> float | None:
    if score_field is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise KilnError(f"{url}, {where}: score field {score_field!r} is {value!r}, "
                        "not a number") from None


def _read_parquet(url: str, column: str, score_field: str | None, stats: ReadStats,
                  storage_options: dict | None) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise KilnError(f"reading {url} needs pyarrow: pip install pyarrow") from None
    with open_input(url, "rb", storage_options) as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
            raise KilnError(f"{url} is not a readable Parquet file: {e}") from None
        names = parquet.schema_arrow.names
        for wanted in filter(None, (column, score_field)):
            if wanted not in names:
                raise KilnError(f"{url} has no column {wanted!r} (its columns: "
                                f"{', '.join(names)}); choose it with --field")
        columns = [c for c in (column, score_field) if c]
        row = 0
        for batch in parquet.iter_batches(batch_size=4096, columns=columns):
            texts = batch.column(column).to_pylist()
            scores = batch.column(score_field).to_pylist() if score_field else [None] * len(texts)
            for text, score in zip(texts, scores):
                row += 1
                if not isinstance(text, str):
                    raise KilnError(f"{url}, row {row}: column {column!r} holds "
                                    f"{type(text).__name__}, not a string")
                stats.documents += 1
                yield Document(text, _score(score, url, f"row {row}", score_field))


def local_cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
