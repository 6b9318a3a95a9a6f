"""`kiln prepare`: raw documents -> token shards on disk, plus a manifest that describes them.

A prepared directory holds, per split ("train", and "val" when a share is held out):
`<split>-00000.bin` (the tokens, uint16 when the vocabulary fits, else uint32, each document
followed by EOS), `<split>-00000.docs.npy` (the end offset of each document in that shard),
optionally `<split>-00000.scores.npy` (a difficulty score per document) and, for supervised
fine-tuning (`kiln prepare --sft`, kiln/data/sft.py), `<split>-00000.mask.bin` (one uint8 per
token: which tokens are trained on), and `manifest.json`
(shards, counts, the tokenizer's fingerprint and a sha256 of each shard). Everything is written
into a hidden staging directory that is renamed into place only when complete, so a crash never
leaves something that looks finished; a rerun on unchanged inputs finds the manifest and does
nothing.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kiln.data.sources import (Document, ReadStats, expand_inputs, is_url, local_cpu_count,
                               read_documents)
from kiln.data.tokenizer import TokenizerInfo, save_tokenizer
from kiln.errors import KilnError, os_error
from kiln.outputs import check_output_dir

MANIFEST = "manifest.json"
FORMAT = "kiln-shards/1"
_CHUNK_CHARS = 1 << 20  # documents are sent to workers in chunks of about this many characters
# The tokenizer needs ~120 bytes per character of one word (a 50 MB line without whitespace:
# 6 GB), so documents are tokenized in pieces of at most _PIECE_CHARS, _ENCODE_CHARS at a time.
_PIECE_CHARS = 1 << 16
_ENCODE_CHARS = 1 << 18
IN_MEMORY = "in-memory documents"


@dataclass
class PrepareOptions:
    fmt: str = "auto"
    """auto (by file suffix), text (one document per file), jsonl or parquet."""
    text_field: str = "text"
    """The JSONL field or Parquet column holding the text."""
    score_field: str | None = None
    """A numeric field/column stored per document, for a difficulty-ordered curriculum."""
    skip_bad_records: bool = False
    """Skip (and count) JSONL lines that are not JSON or lack the field, instead of stopping."""
    shard_tokens: int = 100_000_000
    """Start a new shard after this many tokens (documents are never split across shards)."""
    val_fraction: float = 0.0
    """Share of documents held out as the "val" split (chosen by a hash of the document's index)."""
    workers: int | None = None
    """Tokenizer processes; None means one per core (in-process for small inputs)."""
    progress: bool = True
    storage_options: dict = field(default_factory=dict)
    """Passed to fsspec for URLs (e.g. endpoint_url for an S3-compatible store). Never saved."""


@dataclass
class PrepareResult:
    out_dir: Path
    manifest: dict
    reused: bool
    """True when the directory already held this exact output and nothing was done."""
    stats: ReadStats


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a finished prepare; a KilnError for anything else."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        partial = any(Path(directory).parent.glob(f".{Path(directory).name}.partial*"))
        hint = (" (a partial output from an interrupted prepare exists; rerun kiln prepare)"
                if partial else "")
        raise KilnError(f"{directory} is not a prepared shard directory: no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise KilnError(f"{path}, line {e.lineno}: not valid JSON ({e.msg})") from None
    except ValueError:
        raise KilnError(f"{path} is not UTF-8 JSON: it was damaged; rerun kiln prepare") from None
    except OSError as e:
        raise os_error(e, f"reading {path}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise KilnError(f"{path}: unknown format {found!r}, expected {FORMAT!r}")
    try:  # what readers rely on, checked once here
        np.dtype(manifest["dtype"])
        assert isinstance(manifest["tokenizer"]["vocab_size"], int)
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                assert isinstance(shard["file"], str) and isinstance(shard["docs"], str)
                assert isinstance(shard["tokens"], int) and shard["tokens"] >= 0
    except (KeyError, TypeError, AttributeError, AssertionError):
        raise KilnError(f"{path} lacks fields kiln needs or has them of the wrong type (it was "
                        "edited or damaged); rerun kiln prepare") from None
    return manifest


def prepare(inputs: list[str], tokenizer: TokenizerInfo, out_dir: str | Path,
            options: PrepareOptions | None = None) -> PrepareResult:
    """Tokenize files, globs or URLs into shards in out_dir; a no-op when already done."""
    options = options or PrepareOptions()
    sources = [p if is_url(p) else os.path.abspath(p.removeprefix("file://")) for p in inputs]
    out_dir = _check_out_dir(out_dir, sources)  # before any work: a refusal costs nothing
    # An output inside an input directory (corpus/ -> corpus/prepared) is not read back in.
    files = [f for f in expand_inputs(inputs, options.storage_options)
             if not _written_here(f.url, out_dir)]
    if not files:
        raise KilnError(f"every input file is inside --out {out_dir}")
    key = {"inputs": [[f.url, f.size, f.stamp] for f in files],
           **key_options(tokenizer, options)}
    stats = ReadStats()
    total_bytes = sum(f.size for f in files)
    bar = _progress(options.progress, total_bytes)

    def documents() -> Iterator[Document]:
        for f in files:
            before = stats.documents + stats.bad_records
            yield from read_documents(f, options.fmt, options.text_field, options.score_field,
                                      options.skip_bad_records, stats, options.storage_options)
            if stats.documents + stats.bad_records == before:
                raise KilnError(f"input file {f.url} holds no documents")
            bar.update(f.size)

    try:
        return prepare_documents(documents(), key, tokenizer, out_dir, options, stats, total_bytes,
                                 sources)
    finally:
        bar.close()


def key_options(tokenizer: TokenizerInfo, options: PrepareOptions) -> dict:
    return {"tokenizer": tokenizer.fingerprint, "bos_id": tokenizer.bos_id,
            "eos_id": tokenizer.eos_id, "format": options.fmt, "text_field": options.text_field,
            "score_field": options.score_field, "skip_bad_records": options.skip_bad_records,
            "shard_tokens": options.shard_tokens, "val_fraction": options.val_fraction}


def prepare_texts(texts: list[str], source_fingerprint: str, tokenizer: TokenizerInfo,
                  out_dir: Path, options: PrepareOptions | None = None) -> PrepareResult:
    """Shards from documents already in memory (the stdlib corpus), keyed by their fingerprint."""
    options = options or PrepareOptions()
    key = {"inputs": source_fingerprint, **key_options(tokenizer, options)}
    stats = ReadStats(documents=len(texts))
    return prepare_documents((Document(t) for t in texts), key, tokenizer, out_dir, options,
                             stats, sum(len(t) for t in texts), [IN_MEMORY])


def prepare_documents(documents: Iterable[Document], key: dict, tokenizer: TokenizerInfo,
                      out_dir: str | Path, options: PrepareOptions, stats: ReadStats,
                      total_bytes: int, sources: list[str]) -> PrepareResult:
    """Shards of `documents` into out_dir, replacing only an earlier prepare of `sources`."""
    def fill(writers: dict[str, _ShardWriter]) -> dict:
        index = 0
        for chunk, tokens in _tokenize(documents, tokenizer, options.workers, total_bytes):
            for doc, ids in zip(chunk, tokens):
                writers[split_of(index, options.val_fraction)].add(ids, doc.score)
                index += 1
        return {}

    return write_shards(out_dir, key, tokenizer, options, stats, fill, sources=sources)


def write_shards(out_dir: str | Path, key: dict, tokenizer: TokenizerInfo,
                 options: PrepareOptions, stats: ReadStats,
                 fill: Callable[[dict], dict], with_mask: bool = False,
                 sources: list[str] | None = None) -> PrepareResult:
    """The crash-safe frame of every prepare: a no-op when out_dir already holds `key`'s output;
    else `fill(writers)` adds documents to the "train"/"val" shard writers (and returns extra
    manifest fields) in a staging directory that is renamed into place once complete. out_dir
    is refused unless it is new, empty or an earlier prepare of the same `sources`."""
    if sources is None:
        sources = key["inputs"] if isinstance(key["inputs"], list) else [IN_MEMORY]
    out_dir = _check_out_dir(out_dir, sources)
    key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    if _is_complete(out_dir, key_hash):
        return PrepareResult(out_dir, read_manifest(out_dir), True, stats)

    staging = out_dir.parent / f".{out_dir.name}.partial"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # what an earlier crash left behind
        staging.mkdir()
        dtype = token_dtype(tokenizer.vocab_size)
        writers = {split: _ShardWriter(staging, split, dtype, options.shard_tokens,
                                       options.score_field is not None, with_mask)
                   for split in ("train", "val")}
        extra = fill(writers)
        splits = {split: w.finish() for split, w in writers.items()}
        if not any(split["documents"] for split in splits.values()):
            raise KilnError("the inputs hold no documents")
        manifest = {
            "format": FORMAT, "key": key_hash, "dtype": dtype.name,
            "tokenizer": {"fingerprint": tokenizer.fingerprint,
                          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                          "bos_id": tokenizer.bos_id},
            "options": {k: v for k, v in asdict(options).items()
                        if k not in ("storage_options", "progress", "workers")},
            "sources": sources,
            "inputs": key["inputs"] if isinstance(key["inputs"], list) else None,
            "bad_records": stats.bad_records,
            "invalid_utf8_bytes": stats.invalid_utf8_bytes,
            **extra,
            "splits": splits,
        }
        save_tokenizer(tokenizer, staging)
        _write_json(staging / MANIFEST, manifest)
        _swap_into_place(staging, out_dir)
    except OSError as e:  # a full disk, no permission: the previous output stays as it was
        shutil.rmtree(staging, ignore_errors=True)
        raise os_error(e, f"kiln prepare, writing {out_dir}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # an error leaves nothing half-written
        raise
    return PrepareResult(out_dir, manifest, False, stats)


def _check_out_dir(out_dir: str | Path, sources: list[str]) -> Path:
    """out_dir, resolved; refused unless it is new, empty, or an earlier prepare of `sources`
    holding only what that prepare wrote: a user's files are never replaced."""
    resolved = check_output_dir(out_dir)
    if not resolved.is_dir():
        return resolved
    present = sorted(p.name for p in resolved.iterdir())
    if not present:
        return resolved
    try:
        manifest = read_manifest(resolved)
        written = _written_by(manifest)
    except (KilnError, KeyError, TypeError, AttributeError):
        raise KilnError(f"--out {out_dir} already holds files that are not the output of kiln "
                        f"prepare ({_some(present)}); they would be replaced. Choose a new or "
                        "empty directory") from None
    others = [name for name in present if name not in written]
    if others:
        raise KilnError(f"--out {out_dir} holds files kiln prepare did not write "
                        f"({_some(others)}); they would be lost when the new output replaces the "
                        "directory. Move them, or choose a new or empty directory")
    theirs = _sources_of(manifest)
    if theirs != sources:
        raise KilnError(f"--out {out_dir} holds the kiln prepare output of other inputs "
                        f"({_some(theirs)}); choose another directory, or remove it first if it "
                        "is no longer needed")
    return resolved


def _written_here(url: str, out_dir: Path) -> bool:
    """Whether a file is in out_dir or in one of its staging siblings (.NAME.partial, ...)."""
    if is_url(url):
        return False
    hidden = f".{out_dir.name}."
    return any(p == out_dir or (p.parent == out_dir.parent and p.name.startswith(hidden))
               for p in Path(url).parents)


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _written_by(manifest: dict) -> set[str]:
    """The names of every file a prepare with this manifest wrote."""
    names = {MANIFEST, "tokenizer.json", "tokenizer_config.json"}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            names.update(shard[k] for k in ("file", "docs", "scores", "mask") if k in shard)
    return names


def _sources_of(manifest: dict) -> list[str]:
    """What a manifest was prepared from (older manifests list only the expanded files)."""
    if "sources" in manifest:
        return list(manifest["sources"])
    inputs = manifest.get("inputs")
    return [entry[0] for entry in inputs] if isinstance(inputs, list) else [IN_MEMORY]


def _is_complete(out_dir: Path, key_hash: str) -> bool:
    try:
        manifest = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if manifest.get("key") != key_hash:
        return False
    itemsize = np.dtype(manifest["dtype"]).itemsize

    def whole(name: str | None, size: int) -> bool:
        return name is None or ((out_dir / name).is_file() and (out_dir / name).stat().st_size == size)

    return all(whole(s["file"], s["tokens"] * itemsize) and whole(s.get("mask"), s["tokens"])
               for split in manifest["splits"].values() for s in split["shards"])


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    old = out_dir.parent / f".{out_dir.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except OSError:
        if old.exists():
            old.rename(out_dir)  # the previous output, back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    tmp.replace(path)


def split_of(index: int, val_fraction: float) -> str:
    # A multiplicative hash of the document's position: stable, cheap, spread evenly.
    bucket = ((index + 1) * 0x9E3779B97F4A7C15 % (1 << 64)) / (1 << 64)
    return "val" if bucket < val_fraction else "train"


def _progress(enabled: bool, total: int):
    """A bar over input bytes, advanced as each file is read (on a terminal only)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="kiln prepare", file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()))


class _ShardWriter:
    """One split's shards: tokens (.bin), document ends (.docs.npy), optionally scores and, for
    supervised fine-tuning, a parallel uint8 loss mask per token (.mask.bin)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 with_scores: bool, with_mask: bool = False):
        self.directory, self.split, self.dtype = directory, split, dtype
        self.shard_tokens, self.with_scores, self.with_mask = shard_tokens, with_scores, with_mask
        self.shards: list[dict] = []
        self._file = None

    def _open(self) -> None:
        self._name = f"{self.split}-{len(self.shards):05d}"
        self._file = open(self.directory / f"{self._name}.bin", "wb")
        self._hash, self._tokens, self._ends, self._scores = hashlib.sha256(), 0, [], []
        if self.with_mask:
            self._mask_file = open(self.directory / f"{self._name}.mask.bin", "wb")
            self._mask_hash = hashlib.sha256()

    def add(self, ids: np.ndarray, score: float | None = None, mask: np.ndarray | None = None) -> None:
        if self._file is None:
            self._open()
        data = ids.astype(self.dtype, copy=False).tobytes()
        self._file.write(data)
        self._hash.update(data)
        if self.with_mask:
            mask_data = mask.astype(np.uint8, copy=False).tobytes()
            self._mask_file.write(mask_data)
            self._mask_hash.update(mask_data)
        self._tokens += len(ids)
        self._ends.append(self._tokens)
        self._scores.append(score)
        if self._tokens >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        self._file.close()
        self._file = None
        entry = {"file": f"{self._name}.bin", "tokens": self._tokens,
                 "documents": len(self._ends), "sha256": self._hash.hexdigest(),
                 "docs": f"{self._name}.docs.npy"}
        np.save(self.directory / entry["docs"], np.asarray(self._ends, dtype=np.int64))
        if self.with_mask:
            self._mask_file.close()
            entry.update(mask=f"{self._name}.mask.bin", mask_sha256=self._mask_hash.hexdigest())
        if self.with_scores:
            entry["scores"] = f"{self._name}.scores.npy"
            np.save(self.directory / entry["scores"], np.asarray(self._scores, dtype=np.float32))
        self.shards.append(entry)

    def finish(self) -> dict:
        if self._file is not None:
            self._close()
        return {"tokens": sum(s["tokens"] for s in self.shards),
                "documents": sum(s["documents"] for s in self.shards), "shards": self.shards}


# Tokenization: chunks of documents go to worker processes, results come back in order, so
# the output is the same whatever the number of workers.

def _chunks(documents: Iterable[Document]) -> Iterator[list[Document]]:
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc.text)
        if size >= _CHUNK_CHARS:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker_tokenizer: TokenizerInfo | None = None


def _init_worker(info: dict) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(info.pop("json"))
    _worker_tokenizer = TokenizerInfo(tok, **info)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode_with(_worker_tokenizer, texts)


def _pieces(text: str) -> list[str]:
    """A document cut into pieces of at most _PIECE_CHARS, just before a space where there is
    one in the piece's second half (the tokenizers' pre-tokenizers split there anyway)."""
    pieces, start = [], 0
    while len(text) - start > _PIECE_CHARS:
        end = start + _PIECE_CHARS
        cut = text.rfind(" ", start + _PIECE_CHARS // 2, end)
        cut = cut if cut > start else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _encode_with(tokenizer: TokenizerInfo, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All documents' ids in one flat array, and each one's length: cheap to send between
    processes. Each document is [bos] + ids + [eos]; long ones are encoded piece by piece."""
    encode = getattr(tokenizer.tokenizer, "encode_batch_fast", tokenizer.tokenizer.encode_batch)
    head = np.asarray([tokenizer.bos_id] if tokenizer.bos_id is not None else [], np.uint32)
    tail = np.asarray([tokenizer.eos_id], np.uint32)
    parts: list[np.ndarray | None] = []  # the output in order; None until its piece is encoded
    pending: list[tuple[int, str]] = []
    pending_chars = 0

    def flush() -> None:
        encoded = encode([piece for _, piece in pending], add_special_tokens=False)
        for (slot, _), e in zip(pending, encoded):
            parts[slot] = np.asarray(e.ids, dtype=np.uint32)
        pending.clear()

    spans = []
    for text in texts:
        first = len(parts)
        parts.append(head)
        for piece in _pieces(text):
            if pending and pending_chars + len(piece) > _ENCODE_CHARS:
                flush()
                pending_chars = 0
            pending.append((len(parts), piece))
            parts.append(None)
            pending_chars += len(piece)
        parts.append(tail)
        spans.append((first, len(parts)))
    if pending:
        flush()
    lengths = np.fromiter((sum(len(p) for p in parts[a:b]) for a, b in spans), dtype=np.int64,
                          count=len(spans))
    flat = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return flat, lengths


def _split_docs(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lengths)[:-1])


def _tokenize(documents: Iterable[Document], tokenizer: TokenizerInfo, workers: int | None,
              total_bytes: int) -> Iterator[tuple[list[Document], list[np.ndarray]]]:
    if workers is None:
        workers = 1 if total_bytes < 4 * _CHUNK_CHARS else local_cpu_count()
    if workers <= 1:
        for chunk in _chunks(documents):
            yield chunk, _split_docs(*_encode_with(tokenizer, [d.text for d in chunk]))
        return
    info = {"json": tokenizer.tokenizer.to_str(), "eos_id": tokenizer.eos_id,
            "bos_id": tokenizer.bos_id, "chat_template": tokenizer.chat_template,
            "fingerprint": tokenizer.fingerprint}
    # spawn, not fork: the parent may hold torch and tokenizers thread pools
    ctx = multiprocessing.get_context("spawn")
    with _quiet_pool(ctx, workers, info) as pool:
        pending: list = []
        for chunk in _chunks(documents):
            pending.append((chunk, pool.apply_async(_encode, ([d.text for d in chunk],))))
            if len(pending) >= 2 * workers:  # bounded: inputs may be far larger than memory
                done_chunk, result = pending.pop(0)
                yield done_chunk, _split_docs(*result.get())
        for done_chunk, result in pending:
            yield done_chunk, _split_docs(*result.get())


def _quiet_pool(ctx, workers: int, info: dict):
    """A pool whose workers ignore Ctrl-C: it reaches the whole process group, and the parent
    stops the pool, so no worker prints a KeyboardInterrupt traceback of its own. A worker
    inherits the ignoring from the moment it starts (an ignored signal survives exec)."""
    if threading.current_thread() is not threading.main_thread():
        return ctx.Pool(workers, initializer=_init_worker, initargs=(info,))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(info,))
    finally:
        signal.signal(signal.SIGINT, previous)


def train_tokenizer(inputs: list[str], vocab_size: int, out_dir: str | Path,
                    options: PrepareOptions | None = None, force: bool = False,
                    stats: ReadStats | None = None) -> TokenizerInfo:
    """`kiln tokenizer train`: a byte-level BPE on the inputs' documents, saved to out_dir.

    An existing tokenizer in out_dir is replaced only with `force` (checked before training);
    `stats`, when given, is filled with what reading the inputs found."""
    from kiln.data.tokenizer import describe, train_bpe

    options = options or PrepareOptions()
    out_dir = check_output_dir(out_dir)
    existing = [n for n in ("tokenizer.json", "tokenizer_config.json") if (out_dir / n).exists()]
    if existing and not force:
        raise KilnError(f"{out_dir} already holds {' and '.join(existing)}; pass --force to "
                        "replace it, or choose another --out")
    stats = stats if stats is not None else ReadStats()
    texts = (piece for f in expand_inputs(inputs, options.storage_options)
             for doc in read_documents(f, options.fmt, options.text_field, None,
                                       options.skip_bad_records, stats, options.storage_options)
             for piece in _pieces(doc.text))
    tokenizer = train_bpe(texts, vocab_size)
    if stats.documents == 0:
        raise KilnError("the inputs hold no documents to train a tokenizer on")
    info = describe(tokenizer)
    try:
        save_tokenizer(info, out_dir)
    except OSError as e:
        raise os_error(e, f"writing the tokenizer to {out_dir}") from None
    return info
