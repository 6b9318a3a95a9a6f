"""Tokenizers through Hugging Face `tokenizers`: load any tokenizer.json, or train a BPE."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kiln.errors import KilnError

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
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


@dataclass
class TokenizerInfo:
    """A tokenizer with what packing needs to know about it."""

    tokenizer: Tokenizer
    eos_id: int
    bos_id: int | None
    """Prepended to every document when the tokenizer's config asks for it (Llama), else None."""
    chat_template: str | None
    fingerprint: str
    """sha256 of the tokenizer's JSON: shards record it, so a mismatched tokenizer is refused."""
    special_tokens: dict[str, str] = field(default_factory=dict)
    """bos_token, eos_token, ... as strings: what a chat template sees (transformers passes the
    same), whether or not BOS is added to documents."""

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each document as [bos] + ids + [eos]: we add the special tokens, not the post-processor."""
        head = [self.bos_id] if self.bos_id is not None else []
        # encode_batch_fast (tokenizers >= 0.21) skips computing character offsets we never use
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [head + e.ids + [self.eos_id] for e in encode(texts, add_special_tokens=False)]


_EOS_GUESSES = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


def fingerprint(tokenizer: Tokenizer) -> str:
    return hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    """A Hugging Face tokenizer: a tokenizer.json file, or a model directory holding one.

    tokenizer_config.json, when next to it, gives the EOS/BOS tokens, whether to add BOS, and
    the chat template.
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no tokenizer.json" if path.is_dir() else f"{path} does not exist"
        raise KilnError(f"cannot load the tokenizer: {where}")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise KilnError(f"{file} is not a Hugging Face tokenizer.json: {e}") from None
    config_file = file.parent / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_bytes())
        except json.JSONDecodeError as e:
            raise KilnError(f"{config_file}, line {e.lineno}, column {e.colno}: not valid "
                            f"JSON ({e.msg})") from None
        except ValueError:
            raise KilnError(f"{config_file} is not UTF-8 JSON") from None
        if not isinstance(config, dict):
            raise KilnError(f"{config_file} holds a JSON {type(config).__name__}, not an object "
                            "of tokenizer settings")
    return describe(tokenizer, config, str(file))


def describe(tokenizer: Tokenizer, config: dict | None = None,
             where: str = "the tokenizer") -> TokenizerInfo:
    """EOS, BOS and chat template from a tokenizer_config.json dict (EOS guessed when absent)."""
    config = config or {}

    def token(name: str) -> str | None:
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    eos = token("eos_token")
    if eos is None:
        eos = next((t for t in _EOS_GUESSES if tokenizer.token_to_id(t) is not None), None)
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    if eos_id is None:
        raise KilnError(f"{where}: no end-of-text token found (looked for eos_token in "
                        f"tokenizer_config.json, then {', '.join(_EOS_GUESSES)}); packing "
                        "needs one to separate documents")
    bos = token("bos_token")
    add_bos = config.get("add_bos_token", bos is not None and bos != eos)
    bos_id = tokenizer.token_to_id(bos) if (bos and add_bos) else None
    special = {name: value for name in ("bos_token", "eos_token", "unk_token", "pad_token")
               if isinstance(value := token(name), str)}
    special["eos_token"] = eos
    return TokenizerInfo(tokenizer, eos_id, bos_id, config.get("chat_template"),
                         fingerprint(tokenizer), special)


def save_tokenizer(info: TokenizerInfo, directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json into `directory`, each written then renamed."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"eos_token": info.tokenizer.id_to_token(info.eos_id),
              "add_bos_token": info.bos_id is not None}
    if info.bos_id is not None:
        config["bos_token"] = info.tokenizer.id_to_token(info.bos_id)
    elif "bos_token" in info.special_tokens:  # templates may write it even when it is not added
        config["bos_token"] = info.special_tokens["bos_token"]
    if info.chat_template:
        config["chat_template"] = info.chat_template
    tmp = directory / "tokenizer.json.tmp"
    info.tokenizer.save(str(tmp))
    tmp.replace(directory / "tokenizer.json")
    tmp = directory / "tokenizer_config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(directory / "tokenizer_config.json")
