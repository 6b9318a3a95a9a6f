"""Byte-level BPE tokenizers through Hugging Face `tokenizers`: train on a corpus, save, load."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def cached_bpe(path: Path, texts: list[str], vocab_size: int, fingerprint: str) -> Tokenizer:
    """The tokenizer at `path` if it was trained on the same corpus and size, else a new one."""
    key = {"corpus": fingerprint, "vocab_size": vocab_size}
    stamp = path.with_suffix(".key.json")
    if path.exists() and stamp.exists() and json.loads(stamp.read_text()) == key:
        return Tokenizer.from_file(str(path))
    tokenizer = train_bpe(texts, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)
    stamp.write_text(json.dumps(key))
    return tokenizer
