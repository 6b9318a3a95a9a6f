"""Every layout trains the same model as one process: real torchrun processes over gloo.

Each layout runs 10 steps in float32 on the same global batch (train.global_batch_size fixed, so
the same samples in the same order whatever the data-parallel degree) and must give the
single-process losses within 1e-5 relative and the same final weights. Jobs of one world size
share one torchrun launch (starting processes and importing torch dominate on two cores).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, tiny_job, torchrun
from kiln.train.trainer import train

STEPS = 10


def job(tmp, name: str, parallel: dict | None = None, tie: bool = True, **sections) -> dict:
    """A 4-layer tiny model (interleaved pipelines need two stages per rank), 16 sequences a step."""
    base = dict(
        name=name,
        # Qwen-style q/k/v biases and per-head q/k norms: tensor parallel splits those too.
        model={"n_layers": 4, "tie_embeddings": tie, "qkv_bias": tie, "qk_norm": tie},
        train={"micro_batch_size": 4, "global_batch_size": 16, "max_steps": STEPS, "log_interval": 5,
               "eval_interval": 100, "eval_batches": 1, "sample_tokens": 0, "num_threads": 1},
        checkpoint={"enabled": False},
        parallel=parallel or {},
    )
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_job(tmp, **base).model_dump(mode="json", by_alias=True)


def run_dir(tmp, name: str):
    return tmp / "runs" / name


def seed_run_dir(tmp, name: str, ref: str) -> None:
    """The reference run's tokenizer and token shards, so a job does not make them again."""
    src, dst = run_dir(tmp, ref), run_dir(tmp, name)
    dst.mkdir(parents=True, exist_ok=True)
    for item in ("tokenizer.json", "tokenizer.key.json"):
        shutil.copy(src / item, dst / item)
    shutil.copytree(src / "data", dst / "data", dirs_exist_ok=True)


def launch(tmp, nproc: int, jobs: list[tuple[dict, str, str]]) -> dict:
    """Run (config, resume, reference run) jobs in one torchrun launch of nproc ranks."""
    for config, _, ref in jobs:
        seed_run_dir(tmp, config["name"], ref)
    spec, out = tmp / f"jobs{nproc}.json", tmp / f"results{nproc}.json"
    spec.write_text(json.dumps([{"config": c, "resume": r} for c, r, _ in jobs]))
    torchrun([str(ROOT / "tests/workers/dist_jobs.py"), str(spec), str(out)], nproc=nproc, timeout=600)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("parallel")


@pytest.fixture(scope="module")
def reference(tmp):
    """One process, tied embeddings (every layout but pipelines) and untied (pipelines)."""
    torch.set_num_threads(1)
    losses = {}
    for name, tie in (("ref_tied", True), ("ref_untied", False)):
        from kiln.config import JobConfig

        losses[name] = train(JobConfig.model_validate(job(tmp, name, tie=tie)), resume="none").losses
        if name == "ref_tied":
            seed_run_dir(tmp, "ref_untied", "ref_tied")
    return losses


@pytest.fixture(scope="module")
def two_ranks(tmp, reference):
    return launch(tmp, 2, [
        # Checkpoints at steps 5 and 10: resumed below under other layouts.
        (job(tmp, "fsdp", checkpoint={"enabled": True, "interval": 5, "keep_last": None}), "none", "ref_tied"),
        (job(tmp, "dp", {"dp_replicate": 2, "dp_shard": 1}), "none", "ref_tied"),
        # With activation checkpointing: the recompute replays the first block from its
        # unsliced input (tensor parallel's entry hook slices it).
        (job(tmp, "tp", {"tp": 2}, train={"activation_checkpointing": True}), "none", "ref_tied"),
        (job(tmp, "fsdp_to_tp", {"tp": 2}), str(checkpoint(tmp, "fsdp", 5)), "ref_tied"),
        (job(tmp, "pp_1f1b", {"pp": 2}, tie=False), "none", "ref_untied"),
        (job(tmp, "pp_interleaved", {"pp": 2, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2},
             tie=False), "none", "ref_untied"),
        (job(tmp, "pp_zero_bubble", {"pp": 2, "pp_schedule": "InterleavedZeroBubble",
                                     "pp_stages_per_rank": 2}, tie=False), "none", "ref_untied"),
    ])


def checkpoint(tmp, name: str, step: int):
    return run_dir(tmp, name) / "checkpoints" / f"step-{step:06d}"


def assert_same_run(tmp, results: dict, reference: dict, name: str, ref: str) -> None:
    start = results[name]["start_step"]
    got, want = results[name]["losses"], reference[ref][start:]
    assert len(got) == STEPS - start
    assert got == pytest.approx(want, rel=1e-5), name
    ours, theirs = (load_file(run_dir(tmp, n) / "model.safetensors") for n in (name, ref))
    assert ours.keys() == theirs.keys()
    # AdamW normalises each update: a gradient entry near zero in both runs, differing only by
    # float32 rounding (another summation order across ranks), can still move its weight by a
    # visible fraction of lr. 2e-4 is 0.3% of the lr x steps a weight can move at most; a wrong
    # gradient (a missed reduction, a lost tie) moves the losses far beyond 1e-5 first.
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=2e-4, msg=f"{name}: {key}")


@pytest.fixture(scope="module")
def four_ranks(tmp, reference):
    return launch(tmp, 4, [
        (job(tmp, "hsdp", {"dp_replicate": 2, "dp_shard": 2}), "none", "ref_tied"),
        (job(tmp, "fsdp_tp", {"dp_shard": 2, "tp": 2}), "none", "ref_tied"),
        (job(tmp, "pp_fsdp", {"pp": 2, "dp_shard": 2}, tie=False), "none", "ref_untied"),
        (job(tmp, "pp_tp", {"pp": 2, "tp": 2}, tie=False, train={"activation_checkpointing": True}),
         "none", "ref_untied"),
    ])


@pytest.mark.parametrize("name", ["fsdp", "dp", "tp", "pp_1f1b", "pp_interleaved", "pp_zero_bubble",
                                  "fsdp_to_tp"])
def test_two_rank_layouts_match_one_process(tmp, reference, two_ranks, name):
    assert_same_run(tmp, two_ranks, reference, name, "ref_untied" if name.startswith("pp") else "ref_tied")


@pytest.mark.parametrize("name", ["hsdp", "fsdp_tp", "pp_fsdp", "pp_tp"])
def test_four_rank_layouts_match_one_process(tmp, reference, four_ranks, name):
    assert_same_run(tmp, four_ranks, reference, name, "ref_untied" if name.startswith("pp") else "ref_tied")


def test_a_two_rank_fsdp_checkpoint_resumes_in_one_process(tmp, reference, two_ranks):
    """Model, optimizer, schedule and data position saved as 2 FSDP2 shards continue in one
    process exactly where the 2-rank run went on (the data position is global, so a change of
    data-parallel degree resumes at the same sample)."""
    from kiln.config import JobConfig

    cfg = JobConfig.model_validate(job(tmp, "fsdp_to_one"))
    seed_run_dir(tmp, "fsdp_to_one", "ref_tied")
    result = train(cfg, resume=str(checkpoint(tmp, "fsdp", 5)))
    assert_same_run(tmp, {"fsdp_to_one": {"losses": result.losses, "start_step": result.start_step}},
                    reference, "fsdp_to_one", "ref_tied")
    assert result.start_step == 5
