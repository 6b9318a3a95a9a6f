"""From the data config to a tokenizer, a training loader and fixed validation sets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from kiln.config import JobConfig, plan_batch
from kiln.data.corpus import load_stdlib_corpus
from kiln.data.loader import ShardLoader, fixed_batches
from kiln.data.prepare import PrepareOptions, prepare_texts
from kiln.data.sampler import Sampler, Stage
from kiln.data.shards import PackedSamples, ShardSet
from kiln.data.tokenizer import TokenizerInfo, cached_bpe, describe, load_tokenizer, save_tokenizer
from kiln.errors import KilnError


@dataclass
class Data:
    tokenizer: Tokenizer
    train: ShardLoader
    val: list
    """Batches of the first validation set (the one reported as val_loss)."""
    train_tokens: int
    """Tokens in one epoch of all training sources."""
    val_sets: dict[str, list] = field(default_factory=dict)
    """Every validation set by name, `val` first; each is reported separately."""
    info: TokenizerInfo | None = None
    val_samples: dict = field(default_factory=dict)
    """The samples each validation set's batches were made of, by name."""


ShardSets = tuple[TokenizerInfo, list[tuple[str, ShardSet]], list[tuple[str, ShardSet]]]


def build_data(cfg: JobConfig, run_dir: Path, rank: int = 0, world_size: int = 1,
               sets: Callable[[JobConfig, Path], ShardSets] | None = None,
               samples: Callable[[str, ShardSet, bool], object] | None = None) -> Data:
    """rank, world_size: this process's place among the data-parallel ranks (each reads its
    own slice of every global batch; tensor/pipeline peers of one replica read the same).

    A task may say where the shards come from (`sets`: tokenizer, train and val sets; default:
    the stdlib corpus or data.sources) and how a set becomes samples (`samples(name, shards,
    is_train)`; default: packed seq_len windows, kiln/data/shards.py).
    """
    if sets is not None:
        info, train, val = sets(cfg, Path(run_dir))
    elif cfg.data.source == "stdlib":
        info, train, val = _stdlib_shards(cfg, Path(run_dir))
    else:
        info, train, val = prepared_shards(cfg, Path(run_dir))
    seq_len, batch = cfg.data.seq_len, cfg.train.micro_batch_size
    for name, shards in train + val:
        if shards.tokenizer_fingerprint != info.fingerprint:
            raise KilnError(f"data source {name!r} ({shards.directory}) was prepared with a "
                            "different tokenizer than this run uses; prepare it again with it")
    if info.vocab_size > cfg.model.vocab_size:
        raise KilnError(f"the tokenizer has {info.vocab_size} tokens but model.vocab_size is "
                        f"{cfg.model.vocab_size}: token ids would fall outside the embedding")
    samples = samples or (lambda name, s, is_train: PackedSamples(
        s, seq_len, _order(cfg, name) if is_train else "shuffle"))
    train_samples = [samples(name, s, True) for name, s in train]
    val_samples = {name: samples(name, s, False) for name, s in val}
    for name, found in [*zip([n for n, _ in train], train_samples), *val_samples.items()]:
        if len(found) == 0:
            raise KilnError(f"data source {name!r} ({found.shards.directory}) gives not one "
                            f"sequence of data.seq_len={seq_len}")
    names = [name for name, _ in train]
    sampler = Sampler([len(s) for s in train_samples], _stages(cfg, names, world_size),
                      cfg.train.seed, batch, rank, world_size,
                      shuffle=[s.order == "shuffle" for s in train_samples])
    pin = torch.cuda.is_available() and cfg.train.device != "cpu"
    loader = ShardLoader(train_samples, names, sampler, cfg.data.prefetch, pin)
    val_sets = {name: fixed_batches(s, batch, cfg.train.eval_batches)
                for name, s in val_samples.items()}
    return Data(info.tokenizer, loader, next(iter(val_sets.values())),
                sum(s.total_tokens for _, s in train), val_sets, info, val_samples)


def _order(cfg: JobConfig, name: str) -> str:
    return next((s.order for s in cfg.data.sources if s.name == name), "shuffle")


def _stdlib_shards(cfg: JobConfig, run_dir: Path):
    """The quickstart corpus, tokenized once into shards in the run directory (cached by content)."""
    corpus = load_stdlib_corpus(cfg.data.val_fraction, cfg.data.max_bytes)
    tokenizer = cached_bpe(run_dir / "tokenizer.json", corpus.train, cfg.model.vocab_size,
                           corpus.fingerprint)
    info = describe(tokenizer)
    # In-process: the texts are already in memory, and tokenizers' encode_batch uses every
    # core on its own; no worker processes to spawn from inside a training job.
    options = PrepareOptions(progress=False, workers=1)
    out = {}
    for split, texts in (("train", corpus.train), ("val", corpus.val)):
        result = prepare_texts(texts, f"stdlib:{split}:{corpus.fingerprint}", info,
                               run_dir / "data" / f"stdlib-{split}", options)
        out[split] = ShardSet(result.out_dir, "train")
    return info, [("stdlib", out["train"])], [("stdlib", out["val"])]


def prepared_shards(cfg: JobConfig, run_dir: Path):
    dcfg = cfg.data
    train = [(s.name, _open(f"data.sources '{s.name}'", s.path, s.split)) for s in dcfg.sources]
    val = [(v.name, _open(f"data.val '{v.name}'", v.path, v.split)) for v in dcfg.val]
    info = load_tokenizer(dcfg.tokenizer or dcfg.sources[0].path)
    save_tokenizer(info, run_dir)  # the run directory is self-contained: sampling, export
    if not val:
        raise KilnError("data.val is empty: name at least one held-out set (e.g. the 'val' split "
                        "that kiln prepare --val-fraction writes)")
    return info, train, val


def _open(key: str, path: str, split: str) -> ShardSet:
    try:
        return ShardSet(path, split)
    except KilnError as e:
        raise KilnError(f"{key}: {e}") from None


def _stages(cfg: JobConfig, names: list[str], world_size: int) -> list[Stage]:
    """Curriculum stages in global sample slots; one open-ended stage without a curriculum."""
    base = np.asarray([next((s.weight for s in cfg.data.sources if s.name == n), 1.0)
                       for n in names])
    if not cfg.data.curriculum:
        return [Stage(until=2**62, weights=base / base.sum())]
    plan = plan_batch(cfg, world_size)
    if not plan.total_steps:
        raise KilnError("data.curriculum is by training progress: set train.max_steps or "
                        "train.max_tokens so the run's length is known")
    total_steps, slots_per_step = plan.total_steps, plan.global_batch_size
    stages = []
    for stage in cfg.data.curriculum:
        weights = (np.asarray([stage.weights.get(n, 0.0) for n in names])
                   if stage.weights is not None else base)
        # Stages end on optimizer-step boundaries, so all micro-batches of a step share one.
        until = round(stage.until * total_steps) * slots_per_step
        stages.append(Stage(until, weights / weights.sum(), stage.seq_len))
    return stages
