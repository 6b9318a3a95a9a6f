"""`kiln prepare --sft`: conversations -> token shards plus a loss mask per token.

Inputs are JSONL lines or Parquet rows, each either `messages` (a list of {role, content} with
roles system, user, assistant; several turns allowed) or `prompt` and `response` strings (with
an optional `system`), which become a user and an assistant message. Each conversation goes
through the chat template (kiln/data/chat.py) and is stored as one document of the usual
shards, with a parallel `.mask.bin` of one byte per token: 0 prompt or template, 1 an
assistant turn, 2 the last assistant turn. Which of them are trained on (`sft.loss_on`) and
how long examples are handled (`sft.overlong`) are chosen by the job, not here, so one
prepared set serves any seq_len.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from kiln.data.chat import LAST_TURN, PROMPT, ChatFormat, check_messages
from kiln.data.prepare import (PrepareOptions, PrepareResult, key_options, split_of,
                               write_shards)
from kiln.data.sources import (InputFile, ReadStats, bad_record, detect_format, expand_inputs,
                               jsonl_records, open_input)
from kiln.data.tokenizer import TokenizerInfo
from kiln.errors import KilnError

FIELDS = ("messages", "prompt", "response", "system")


def to_messages(record, where: str) -> list[dict]:
    """A record's conversation: its `messages`, or `prompt`/`response` (and `system`)."""
    if not isinstance(record, dict):
        raise KilnError(f"{where}: a {type(record).__name__}, not an object with 'messages' "
                        "or 'prompt' and 'response'")
    if record.get("messages") is not None:
        return check_messages(record["messages"], where)
    if record.get("prompt") is None and record.get("response") is None:
        keys = ", ".join(k for k, v in record.items() if v is not None) or "nothing"
        raise KilnError(f"{where}: no 'messages' field and no 'prompt'/'response' fields "
                        f"(the record has: {keys})")
    messages = []
    for name, role in (("system", "system"), ("prompt", "user"), ("response", "assistant")):
        value = record.get(name)
        if value is None and name != "system":
            raise KilnError(f"{where}: has '{'response' if name == 'prompt' else 'prompt'}' "
                            f"but no '{name}' field")
        if value is not None:
            if not isinstance(value, str):
                raise KilnError(f"{where}: field '{name}' is a {type(value).__name__}, not a string")
            messages.append({"role": role, "content": value})
    return messages


def _records(file: InputFile, fmt: str, skip: bool, stats: ReadStats,
             storage_options: dict | None) -> Iterator[tuple[str, object]]:
    """(where, record) for each JSONL line or Parquet row of one file."""
    kind = detect_format(file.url, fmt)
    if file.size == 0:
        raise KilnError(f"input file {file.url} is empty")
    if kind == "jsonl":
        for lineno, record in jsonl_records(file.url, skip, stats, storage_options):
            yield f"{file.url}, line {lineno}", record
    elif kind == "parquet":
        import pyarrow.parquet as pq

        with open_input(file.url, "rb", storage_options) as f:
            try:
                parquet = pq.ParquetFile(f)
            except Exception as e:  # pyarrow raises ArrowInvalid for a file that is not Parquet
                raise KilnError(f"{file.url} is not a readable Parquet file: {e}") from None
            columns = [c for c in FIELDS if c in parquet.schema_arrow.names]
            if "messages" not in columns and not {"prompt", "response"} <= set(columns):
                raise KilnError(f"{file.url} has no 'messages' column and no 'prompt' and "
                                f"'response' columns (its columns: "
                                f"{', '.join(parquet.schema_arrow.names)})")
            row = 0
            for batch in parquet.iter_batches(batch_size=1024, columns=columns):
                for record in batch.to_pylist():
                    row += 1
                    yield f"{file.url}, row {row}", record
    else:
        raise KilnError(f"kiln prepare --sft reads JSONL or Parquet; {file.url} is read as "
                        f"{kind} (name it .jsonl/.parquet or pass --format)")


def prepare_sft(inputs: list[str], tokenizer: TokenizerInfo, out_dir: str | Path,
                options: PrepareOptions | None = None,
                chat_template: str | None = None) -> PrepareResult:
    """Conversations in files, globs or URLs -> SFT shards in out_dir; a no-op when done."""
    options = options or PrepareOptions()
    chat = ChatFormat(tokenizer, chat_template)
    files = expand_inputs(inputs, options.storage_options)
    key = {"inputs": [[f.url, f.size, f.stamp] for f in files], **key_options(tokenizer, options)}
    stats = ReadStats()

    def conversations() -> Iterator[list[dict]]:
        for f in files:
            before = stats.documents + stats.bad_records
            for where, record in _records(f, options.fmt, options.skip_bad_records, stats,
                                          options.storage_options):
                try:
                    messages = to_messages(record, where)
                except KilnError as e:
                    bad_record(stats, options.skip_bad_records, str(e))
                    continue
                stats.documents += 1
                yield messages
            if stats.documents + stats.bad_records == before:
                raise KilnError(f"input file {f.url} holds no examples")

    return write_conversations(conversations(), key, chat, out_dir, options, stats)


def write_conversations(conversations: Iterable[list[dict]], key: dict, chat: ChatFormat,
                        out_dir: str | Path, options: PrepareOptions,
                        stats: ReadStats | None = None) -> PrepareResult:
    """Rendered, tokenized and masked conversations into shards (split by options.val_fraction)."""
    stats = stats or ReadStats()
    key = {**key, "sft_template": hashlib.sha256(chat.source.encode()).hexdigest()}

    def fill(writers: dict) -> dict:
        targets = np.zeros(3, dtype=np.int64)  # tokens per mask value
        examples = 0
        for index, messages in enumerate(conversations):
            encoded = chat.encode(messages)
            writers[split_of(index, options.val_fraction)].add(encoded.ids, None, encoded.mask)
            targets += np.bincount(encoded.mask, minlength=3)
            examples += 1
        return {"sft": {"template": chat.kind, "chat_template": chat.source,
                        "examples": examples, "assistant_tokens": int(targets[1:].sum()),
                        "last_turn_tokens": int(targets[LAST_TURN]),
                        "prompt_tokens": int(targets[PROMPT])}}

    return write_shards(out_dir, key, chat.tokenizer, options, stats, fill, with_mask=True)
