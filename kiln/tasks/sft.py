"""Supervised fine-tuning: prompt/response examples, the loss on the responses only.

The loss is pretraining's (chunked cross-entropy summed over the targets, divided by the
trainer by the global count of targets); what differs is the data: examples prepared with a
loss mask (kiln/data/sft.py), packed or padded into rows (kiln/data/packing.py). With
data.source 'stdlib' the run builds the embedded docstring task itself (kiln/data/docstrings.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kiln.config import JobConfig, load_config
from kiln.data.chat import ChatFormat
from kiln.data.docstrings import docstring_pairs
from kiln.data.packing import SFTExamples
from kiln.data.pipeline import Data, ShardSets, build_data
from kiln.data.prepare import PrepareOptions, key_options
from kiln.data.sft import write_conversations
from kiln.data.shards import ShardSet
from kiln.data.tokenizer import load_tokenizer, save_tokenizer
from kiln.errors import KilnError
from kiln.parallel.mesh import rank_world
from kiln.tasks.pretrain import Pretrain


class Sft(Pretrain):
    name = "sft"
    sparse_targets = True

    def build_data(self, cfg: JobConfig, run_dir: Path, dp_rank: int, dp_size: int) -> Data:
        if any(stage.seq_len for stage in cfg.data.curriculum):
            raise KilnError("data.curriculum seq_len stages are for pretraining; task sft packs "
                            "whole examples into data.seq_len")
        s = cfg.sft

        def samples(name: str, shards: ShardSet, is_train: bool) -> SFTExamples:
            return SFTExamples(shards, cfg.data.seq_len, s.loss_on, s.overlong, s.packing,
                               seed=cfg.train.seed if is_train else None)

        data = build_data(cfg, run_dir, dp_rank, dp_size, samples=samples,
                          sets=docstring_sets if cfg.data.source == "stdlib" else None)
        if rank_world()[0] == 0:
            for name, examples in zip(data.train.names, data.train.sources):
                print(f"kiln: sft train {name!r}: {examples.counts.describe()}", flush=True)
            for name, examples in data.val_samples.items():
                print(f"kiln: sft val {name!r}: {examples.counts.describe()}", flush=True)
        return data

    @torch.no_grad()
    def sample(self, model: nn.Module, run) -> str:
        """Greedy replies to a few held-out prompts, each next to its reference."""
        n, budget = run.cfg.sft.samples, run.cfg.train.sample_tokens
        examples = next(iter(run.data.val_samples.values()))
        if n == 0 or budget == 0 or examples.counts.kept == 0:
            return ""
        decode = run.data.tokenizer.decode
        picks = sorted(set(np.linspace(0, examples.counts.kept - 1, n).round().astype(int).tolist()))
        model.eval()
        shown = []
        for k in picks:
            prompt, reply = examples.prompt_and_reply(k)
            with run.amp:  # every rank runs the same steps: sharded forwards need them all
                ids = greedy(model, prompt.tolist(), budget, run.data.info.eos_id, run.device)
            shown.append(f"--- held-out prompt ---\n{decode(prompt.tolist()).strip()}\n"
                         f"--- generated ---\n{decode(ids).strip()}\n"
                         f"--- reference ---\n{decode(reply.tolist()).strip()}")
        model.train()
        return "\n".join(shown)


def greedy(model: nn.Module, prompt: list[int], n_new: int, eos_id: int,
           device: torch.device) -> list[int]:
    """Up to n_new argmax tokens after prompt, stopping at EOS (a demo: no KV cache)."""
    tokens = torch.tensor([prompt], device=device)
    out: list[int] = []
    for _ in range(n_new):
        logits = model(tokens[:, -model.cfg.max_seq_len:])[:, -1]
        nxt = int(logits.argmax(-1))
        if nxt == eos_id:
            break
        out.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def docstring_sets(cfg: JobConfig, run_dir: Path) -> ShardSets:
    """The docstring task in the base model's tokenizer and the chat template, prepared once into
    <run>/data/docstrings-{train,val} (cached by the stdlib's content, tokenizer and template)."""
    where = cfg.data.tokenizer or cfg.model.init_from
    if where is None:
        raise KilnError("task sft with data.source stdlib (the docstring task) fine-tunes a "
                        "pretrained model: set model.init_from (its tokenizer is used) or "
                        "data.tokenizer")
    info = load_tokenizer(where)
    save_tokenizer(info, run_dir)  # the run directory is self-contained: sampling, export
    chat = ChatFormat(info, cfg.sft.chat_template)
    train, held_out, fingerprint = docstring_pairs(cfg.data.val_fraction, cfg.data.max_bytes)
    options = PrepareOptions(progress=False, workers=1)
    sets = []
    for split, pairs in (("train", train), ("val", held_out)):
        key = {"inputs": f"docstring-summaries:{split}:{fingerprint}", **key_options(info, options)}
        result = write_conversations(_conversations(pairs, split, cfg), key, chat,
                                     run_dir / "data" / f"docstrings-{split}", options)
        sets.append([("docstrings", ShardSet(result.out_dir, "train"))])
    return info, sets[0], sets[1]


def _conversations(pairs, split: str, cfg: JobConfig):
    n = 0
    for pair in pairs:
        n += 1
        yield pair.messages()
    if n == 0:
        raise KilnError(f"the docstring task's {split} split has no function with a docstring "
                        f"(data.val_fraction={cfg.data.val_fraction}, data.max_bytes="
                        f"{cfg.data.max_bytes}: hold out more, or read more of the stdlib)")


def ensure_base(cfg: JobConfig) -> None:
    """Make model.init_from from sft.base_job when it is missing or older than that job's
    weights: train the base job first if it has no final weights, then export it there."""
    if cfg.sft.base_job is None or cfg.model.init_from is None:
        return
    base = load_config(cfg.sft.base_job, cfg.sft.base_overrides)
    weights = base.run_dir / "model.safetensors"
    target = Path(cfg.model.init_from)
    if not weights.is_file():
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:  # before the process group exists
            raise KilnError(f"model.init_from {target} does not exist: train sft.base_job "
                            f"{cfg.sft.base_job} first (it is trained in-process only in a "
                            "single-process run)")
        from kiln.train.trainer import train  # the trainer imports the tasks: import late

        print(f"kiln: no base model at {target}: pretraining {cfg.sft.base_job} "
              f"({' '.join(cfg.sft.base_overrides) or 'as written'}) into {base.run_dir} first",
              flush=True)
        result = train(base)
        print(f"kiln: base model: {result.steps} steps, validation loss "
              f"{result.val_losses[0][1]:.3f} -> {result.val_losses[-1][1]:.3f}", flush=True)
    stamp = target / "config.json"
    if stamp.is_file() and stamp.stat().st_mtime >= weights.stat().st_mtime:
        return
    from kiln.checkpoint.hf_export import export_hf

    if target.exists():  # an export of older weights of the base job: ours to replace
        shutil.rmtree(target)
    export_hf(str(base.run_dir), target, dtype="fp32")
    print(f"kiln: exported {base.run_dir} to {target} (the base model)", flush=True)
