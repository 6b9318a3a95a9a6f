"""From the data config to a tokenizer, a training loader and a fixed validation set."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from kiln.config import JobConfig
from kiln.data.corpus import load_stdlib_corpus
from kiln.data.loader import PackedLoader, fixed_batches, pack, tokenize_documents
from kiln.data.tokenizer import cached_bpe
from kiln.errors import KilnError


@dataclass
class Data:
    tokenizer: Tokenizer
    train: PackedLoader
    val: list
    train_tokens: int


def build_data(cfg: JobConfig, run_dir: Path) -> Data:
    corpus = load_stdlib_corpus(cfg.data.val_fraction, cfg.data.max_bytes)
    tokenizer = cached_bpe(run_dir / "tokenizer.json", corpus.train, cfg.model.vocab_size,
                           corpus.fingerprint)
    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise KilnError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens but "
                        f"model.vocab_size is {cfg.model.vocab_size}")
    seq_len, batch = cfg.data.seq_len, cfg.train.micro_batch_size
    train_blocks = pack(tokenize_documents(tokenizer, corpus.train), seq_len)
    val_blocks = pack(tokenize_documents(tokenizer, corpus.val), seq_len)
    if len(train_blocks) < batch or len(val_blocks) == 0:
        raise KilnError(f"the corpus gives {len(train_blocks)} training and {len(val_blocks)} "
                        f"validation sequences of data.seq_len={seq_len}: too few for "
                        f"train.micro_batch_size={batch} (raise data.max_bytes)")
    return Data(tokenizer, PackedLoader(train_blocks, batch, cfg.train.seed),
                fixed_batches(val_blocks, batch, cfg.train.eval_batches), train_blocks.numel())
