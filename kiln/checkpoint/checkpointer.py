"""Save and restore the whole training state with torch.distributed.checkpoint (DCP).

One checkpoint holds the model, the optimizer, the LR schedule, the step/token/time counters,
and per rank the data-loader position and every RNG state, so a resumed run continues the
same loss curve; with guards.skip_bad_steps also the bad-step guard's state (one entry for all
ranks). DCP writes each rank's shards and can load them into another number of ranks.
"""

from __future__ import annotations

import json
import random
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
# The copy helpers behind DCP's own BlockingAsyncStager, which would pin memory even on CPU.
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from kiln.checkpoint.storage import Committed, Storage
from kiln.urls import is_url, redact
from kiln.config import JobConfig
from kiln.errors import KilnError
from kiln.parallel.mesh import rank_world
from kiln.tracking.best import BestCheckpoint

# DCP warns on every call without a process group; one process is a case we mean to support.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

JOB_FILE = "job.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Copied from the run directory into each checkpoint; adapter.json: kiln.peft's record of the
# tuning method and the base's fingerprint (an adapter run's checkpoints hold no base weights).
RUN_FILES = (*TOKENIZER_FILES, "adapter.json")
# Changing these makes weights or optimizer state unusable; everything else may change on resume.
SHAPE_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim",
              "intermediate_size", "qkv_bias", "qk_norm", "tie_embeddings")


# Optimizer state and hyperparameters keyed by parameter name, not by param-group index: a
# layout groups parameters by the mesh they live on, so another layout has other groups.


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    elapsed: float = 0.0
    """Seconds of training so far, so train.max_time counts across restarts."""


@dataclass
class Resumed:
    progress: Progress
    source: str
    changes: dict
    """Config fields that differ from the checkpoint's: {'optim.lr': [old, new], ...}."""
    files: dict[str, str]
    """The run files saved with the checkpoint (RUN_FILES), by name."""
    guard: dict | None = None
    """The bad-step guard's state (StepGuard.state_dict()) at that step; None when the
    checkpoint has none (saved without guards, or by an older kiln)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reader_for(url: str, options: dict):
    return FsspecReader(url, **options) if is_url(url) else dcp.FileSystemReader(url)


class ReusedBuffers(AsyncStager):
    """Stages the state into CPU buffers kept from one save to the next (pinned with a GPU).

    Fresh buffers cost a page fault per 4 KiB: several times the copy itself. Reuse is safe
    because at most one save is in flight and the next stage waits for it.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers = None

    def stage(self, state_dict: dict) -> dict:
        if self._buffers is not None:
            try:
                return _copy_state_dict(state_dict, self._buffers, type_check=False)
            except (CompanionMismatch, RuntimeError):  # the state changed shape: start over
                pass
        self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._buffers, type_check=False)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._buffers = None


class Checkpointer:
    """Periodic saves of (model, optimizer, scheduler, loader) and the resume that undoes a crash."""

    def __init__(self, cfg: JobConfig, run_dir: Path, model: nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler, loader):
        self.cfg, self.ccfg, self.run_dir = cfg, cfg.checkpoint, Path(run_dir)
        self.model, self.optimizer, self.scheduler, self.loader = model, optimizer, scheduler, loader
        self.storage = Storage(self.ccfg.dir or str(self.run_dir / "checkpoints"), self.ccfg.endpoint_url)
        self.rank, self.world = rank_world()
        # A group of our own: background saves must not interleave collectives with training.
        self.group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._executor = self._stager = None
        if self.ccfg.async_save:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kiln-ckpt")
            self._stager = ReusedBuffers()
        self._pending: Future | None = None
        # The best checkpoint by tracking.best_metric: retention always keeps it.
        self.best = BestCheckpoint(self.run_dir, cfg.tracking.best_metric, cfg.tracking.best_mode)
        self.last_saved: int | None = None
        # The bad-step guard (kiln.train.guards.StepGuard), set by the trainer: its spike window,
        # bad-step count and skip list go into every checkpoint, so a restart keeps them.
        self.guard = None

    # -- saving --------------------------------------------------------------------------------

    def maybe_save(self, progress: Progress, final: bool = False) -> None:
        """Save at every checkpoint.interval steps and, with final, at the end of the run."""
        interval = self.ccfg.interval
        if self.ccfg.enabled and (final or (interval and progress.step % interval == 0)):
            self.save(progress)

    def save(self, progress: Progress) -> None:
        if progress.step == self.last_saved:
            return
        self.wait()  # at most one save in flight
        step = progress.step
        if self.rank == 0:
            url = self.storage.prepare(step)
            self.storage.write_text(step, JOB_FILE, self.cfg.to_yaml())
            for name in RUN_FILES:
                if (self.run_dir / name).is_file():
                    self.storage.write_text(step, name, (self.run_dir / name).read_text())
        else:
            url = self.storage.step_url(step)
        if self.group is not None:
            dist.barrier(self.group)
        state = self._state(progress, f"rank{self.rank}", with_guard=self.guard is not None)
        writer = (FsspecWriter(url, sync_files=False, **self.storage.options) if is_url(url)
                  else dcp.FileSystemWriter(url, sync_files=True))
        kwargs = dict(storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        if self._executor is not None:
            # async_save copies the state off the device (staging) before it returns; the
            # files are written and committed in the background while training goes on.
            upload = dcp.async_save(state, async_stager=self._stager, **kwargs)
            self._pending = self._executor.submit(self._commit_when_written, upload, step)
        else:
            try:
                dcp.save(state, **kwargs)
            except Exception as e:  # a full disk, an unreachable store: said as such
                raise self.storage.save_error(e, step) from e
            self._commit(step)
        self.last_saved = step

    def _commit_when_written(self, upload: Future, step: int) -> None:
        try:
            upload.result()
        except Exception as e:
            raise self.storage.save_error(e, step) from e
        self._commit(step)

    def _commit(self, step: int) -> None:
        # Each rank hashes the files it wrote (DCP names them __<rank>_<n>.distcp); rank 0
        # gathers the lists and writes the marker, last, once every rank's files are there.
        mine = self.storage.describe_files(step, f"__{self.rank}_")
        if self.group is not None:
            gathered = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0, group=self.group)
        else:
            gathered = [mine]
        if self.rank == 0:
            files = {name: meta for part in gathered for name, meta in part.items()}
            others = self.storage.describe_files(step, exclude_prefix="__")  # .metadata, job.yaml, ...
            self.storage.commit(step, {"world_size": self.world}, {**files, **others})
            best = self.best.select([c.step for c in self.storage.committed()])
            self.storage.apply_retention(step, self.ccfg.keep_last, self.ccfg.keep_every,
                                         keep={best} - {None})

    def wait(self) -> None:
        """Block until the save in flight, if any, is written and committed (re-raises its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._stager.close()

    # -- resuming ------------------------------------------------------------------------------

    def restore(self, resume: str) -> Resumed | None:
        """Load the checkpoint `resume` names ('auto': the newest committed, 'none', or a path)."""
        # Rank 0 chooses (and re-hashes the files it verifies); the others take its choice
        # instead of every rank reading every file again.
        choice = [None, None]
        if self.rank == 0:
            try:
                committed, storage = self._choose(resume)
                choice = [committed, storage.root if committed else None]
            except KilnError as e:
                choice = [e, None]
        if self.group is not None:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        committed, root = choice
        if isinstance(committed, KilnError):
            raise committed
        if committed is None:
            return None
        storage = self.storage if root == self.storage.root else Storage(root, self.ccfg.endpoint_url)
        progress, guard = self._load(committed, storage)
        changes = self._config_changes(storage, committed.step)
        files = {n: t for n in RUN_FILES if (t := storage.read_text(committed.step, n)) is not None}
        return Resumed(progress, redact(committed.url), changes, files, guard)

    def _choose(self, resume: str) -> tuple[Committed | None, Storage]:
        if resume == "none":
            existing = self.storage.committed() if self.ccfg.enabled else []
            if existing:
                raise KilnError(f"--resume none, but checkpoint.dir {self.storage} already holds "
                                f"checkpoints (newest: step {existing[-1].step}) that a fresh run "
                                "would mix with its own; resume them (--resume auto) or set another "
                                "name or checkpoint.dir")
            return None, self.storage
        if resume == "auto":
            if not self.ccfg.enabled:
                return None, self.storage
            candidates = list(reversed(self.storage.committed()))
            storage = self.storage
            for url, reason in self.storage.skipped.items():  # each once, with its path
                print(f"kiln: skipping checkpoint {redact(url)}: {reason}", flush=True)
        else:
            storage, candidates = _explicit(resume, self.ccfg.endpoint_url)
            newer = [c.step for c in self.storage.committed() if c.step > candidates[0].step]
            if storage.root == self.storage.root and newer:
                print(f"kiln: note: {self.storage} also holds later checkpoints (steps "
                      f"{', '.join(map(str, newer))}) that --resume auto would pick until this run "
                      "saves over them", flush=True)
        for committed in candidates:
            try:
                if self.ccfg.verify:
                    storage.verify(committed)
                return committed, storage
            except KilnError as e:
                if resume != "auto":
                    raise
                print(f"kiln: skipping checkpoint {redact(committed.url)}: {e}", flush=True)
        return None, storage

    def _state(self, progress: Progress, rank_key: str, with_cuda: bool = True,
                with_guard: bool = False) -> dict:
        # Frozen parameters (an adapter run's base) are not saved: they come from the base.
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=StateDictOptions(
            flatten_optimizer_state_dict=True, ignore_frozen_params=True))
        model_state = without_frozen(self.model, model_state)
        rng = rng_state()
        if not with_cuda:
            rng.pop("cuda", None)
        train = {"step": progress.step, "tokens": progress.tokens, "elapsed": progress.elapsed,
                 "scheduler": self.scheduler.state_dict(), "world_size": self.world}
        if with_guard:
            # One JSON string, the same on every rank (the guard decides on all-reduced values):
            # a single replicated entry, taken now (an async save must not see later steps).
            train["guard"] = json.dumps(self.guard.state_dict()) if self.guard is not None else ""
        return {"model": model_state, "optim": optim_state, "train": train,
                rank_key: {"rng": rng, "data": self.loader.state_dict()}}

    def _load(self, committed: Committed, storage: Storage) -> tuple[Progress, dict | None]:
        reader = reader_for(committed.url, storage.options)
        saved = reader.read_metadata().state_dict_metadata
        self._check_shapes(committed, saved)
        rank_key = f"rank{self.rank}" if f"rank{self.rank}.rng.torch" in saved else "rank0"
        if committed.marker.get("world_size", 1) != self.world:
            print(f"kiln: resharding a checkpoint of {committed.marker.get('world_size')} ranks onto "
                  f"{self.world}; ranks without their own data position and RNG take rank 0's", flush=True)
        # Hyperparameters come from this run's config, state from the checkpoint.
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        # A checkpoint without guard state (older, or saved without guards) loads as before.
        state = self._state(Progress(), rank_key, with_cuda=f"{rank_key}.rng.cuda" in saved,
                            with_guard="train.guard" in saved)
        dcp.load(state, storage_reader=reader_for(committed.url, storage.options),
                 process_group=self.group, no_dist=self.group is None)
        frozen = bool(frozen_names(self.model))  # absent from the checkpoint: not strict about them
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(
                           flatten_optimizer_state_dict=True, ignore_frozen_params=True,
                           strict=not frozen))
        train = state["train"]
        for group, h in zip(self.optimizer.param_groups, hyper):
            group.update(h)
        # The schedule's state is its step; the LR at that step comes from this run's config.
        self.scheduler.load_state_dict(train["scheduler"])
        set_rng_state(state[rank_key]["rng"])
        self.loader.load_state_dict(state[rank_key]["data"])
        self.last_saved = train["step"]
        guard = json.loads(train["guard"]) if train.get("guard") else None
        return Progress(train["step"], train["tokens"], train["elapsed"]), guard

    def _check_shapes(self, committed: Committed, saved: dict) -> None:
        frozen = frozen_names(self.model)
        ours = {f"model.{k}": tuple(v.shape) for k, v in self.model.state_dict().items() if k not in frozen}
        problems = []
        for key, shape in ours.items():
            meta = saved.get(key)
            size = tuple(getattr(meta, "size", ()) or ())
            if meta is None:
                problems.append(f"{key[6:]} is missing there")
            elif size != shape:
                problems.append(f"{key[6:]} is {list(size)} there, {list(shape)} here")
        # A pipeline stage holds some of the layers: the others' are there for the other stages.
        extra = [k[6:] for k in saved if k.startswith("model.") and k not in ours
                 and self.cfg.parallel.pp == 1]
        problems += [f"{k} is there but not in this model" for k in extra[:3]]
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise KilnError(f"checkpoint {redact(committed.url)} was saved for a different model "
                            f"shape than this config's model section: {shown}. Use the model "
                            "settings it was trained with, or start a new run (another name or "
                            "checkpoint.dir)")

    def _config_changes(self, storage: Storage, step: int) -> dict:
        text = storage.read_text(step, JOB_FILE)
        if text is None:
            return {}
        old, new = _flatten(yaml.safe_load(text)), _flatten(self.cfg.model_dump(mode="json", by_alias=True))
        return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k)}


def frozen_names(model: nn.Module) -> set[str]:
    """Names of the parameters that do not train (tied ones under each of their names)."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def without_frozen(model: nn.Module, state: dict) -> dict:
    """A model state dict without the frozen parameters under any of their names: DCP's
    ignore_frozen_params keeps a tied frozen weight (a base embedding) under its second name."""
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}


def _flatten(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _explicit(path: str, endpoint_url: str | None) -> tuple[Storage, list[Committed]]:
    """A step directory named by the user: it must carry a valid commit marker."""
    root, _, name = str(path).rstrip("/").rpartition("/")
    storage = Storage(root or ".", endpoint_url)
    step = int(name.removeprefix("step-")) if name.startswith("step-") and name[5:].isdigit() else None
    committed = storage.read(step) if step is not None else None
    if committed is None:
        raise KilnError(f"--resume {redact(path)}: not a committed checkpoint (expected a step-NNNNNN "
                        f"directory holding a valid COMMITTED.json; a save that was interrupted "
                        f"has none)")
    return storage, [committed]


def find_checkpoint(source: str, endpoint_url: str | None = None) -> tuple[Committed, Storage] | None:
    """A committed step directory, or the newest one under a checkpoint root; None if none."""
    source = str(source).rstrip("/")
    if source.rpartition("/")[2].startswith("step-"):
        storage, (committed,) = _explicit(source, endpoint_url)
        return committed, storage
    storage = Storage(source, endpoint_url)
    committed = storage.committed()
    return (committed[-1], storage) if committed else None
