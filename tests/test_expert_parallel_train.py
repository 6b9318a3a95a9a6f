"""Expert parallelism through `kiln train`: real torchrun processes over gloo against one process.

Each layout trains a tiny mixture of experts for 10 steps in float32 on the same global batch
and must give the single-process losses (within 1e-5 relative), gradient norms, MoE metrics
(load per expert, aux and z losses: counted over all ranks) and final weights. The process runs
micro-batches of 16 sequences; a layout's data-parallel ranks together run the same 16
(2 ranks x 8, 4 ranks x 4): the load-balancing loss balances one micro-batch over all ranks.
Layouts: EP over 2 and 4 ranks, EP x FSDP2, EP x TP, EP x HSDP, and EP with compiled blocks.
Jobs of one world size share one torchrun launch.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, tiny_job, torchrun
from kiln.config import JobConfig
from kiln.errors import KilnError
from kiln.launch.layout import resolve_layout
from kiln.train.trainer import train

STEPS = 10
# Qwen3-MoE's shape (exportable to Hugging Face), with the aux and z losses on.
QWEN = dict(n_layers=2, qk_norm=True, moe=dict(n_experts=4, top_k=2, intermediate_size=32,
                                               aux_loss_coef=0.01, router_z_loss_coef=0.001))
# DeepSeek's: a dense first layer, sigmoid gating, a shared expert, the aux-free bias update.
DEEPSEEK = dict(n_layers=2, moe=dict(n_experts=4, top_k=2, intermediate_size=32, first_k_dense=1,
                                     gating="sigmoid", n_shared_experts=1, bias_update_rate=0.01))


def job(tmp, name: str, model: dict, ranks: int = 1, parallel: dict | None = None, **sections) -> dict:
    """32 sequences a step in 2 micro-batches of 16 sequences over all data-parallel ranks."""
    base = dict(
        name=name, model=model, optim={"lr": 3e-3},
        train={"micro_batch_size": 16 // ranks, "global_batch_size": 32, "max_steps": STEPS,
               "log_interval": 5, "eval_interval": 100, "eval_batches": 1, "sample_tokens": 0,
               "num_threads": 1},
        checkpoint={"enabled": False}, parallel=parallel or {})
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_job(tmp, **base).model_dump(mode="json", by_alias=True)


def run_dir(tmp, name: str):
    return tmp / "runs" / name


def checkpoint(tmp, name: str, step: int):
    return run_dir(tmp, name) / "checkpoints" / f"step-{step:06d}"


def seed_run_dir(tmp, name: str, ref: str) -> None:
    """The reference run's tokenizer and token shards, so a job does not make them again."""
    src, dst = run_dir(tmp, ref), run_dir(tmp, name)
    dst.mkdir(parents=True, exist_ok=True)
    for item in ("tokenizer.json", "tokenizer.key.json"):
        shutil.copy(src / item, dst / item)
    shutil.copytree(src / "data", dst / "data", dirs_exist_ok=True)


def launch(tmp, nproc: int, jobs: list[tuple[dict, str]], layouts: list[str]) -> dict:
    """Run (config, reference run) jobs in one torchrun launch of nproc ranks, which must print
    the given layouts."""
    for config, ref in jobs:
        seed_run_dir(tmp, config["name"], ref)
    spec, out = tmp / f"jobs{nproc}.json", tmp / f"results{nproc}.json"
    spec.write_text(json.dumps([{"config": c, "resume": "none"} for c, _ in jobs]))
    output = torchrun([str(ROOT / "tests/workers/dist_jobs.py"), str(spec), str(out)], nproc=nproc,
                      timeout=600)
    for layout in layouts:  # the runs did split their experts
        assert f"layout {layout}," in output
    return json.loads(out.read_text())


def logged(tmp, name: str) -> list[dict]:
    """The gradient norm and MoE figures of each log line. AdamW's update hardly changes when a
    gradient is scaled, so the losses alone would not catch a wrong gradient scale: the norm
    (over every expert once) does."""
    lines = (run_dir(tmp, name) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in r.items() if k.startswith("moe/") or k == "grad_norm"}
            for r in map(json.loads, lines) if "moe/load_max" in r]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def reference(tmp):
    torch.set_num_threads(1)
    losses = {}
    for name, model in (("ref_qwen", QWEN), ("ref_deepseek", DEEPSEEK)):
        ckpt = {"enabled": True, "interval": 5, "keep_last": None}
        losses[name] = train(JobConfig.model_validate(job(tmp, name, model, checkpoint=ckpt)),
                             resume="none").losses
        if name == "ref_qwen":
            seed_run_dir(tmp, "ref_deepseek", "ref_qwen")
    return losses


@pytest.fixture(scope="module")
def two_ranks(tmp, reference):
    # Checkpoints at steps 5 and 10: resumed and exported below in one process.
    ckpt = {"enabled": True, "interval": 5, "keep_last": None}
    return launch(tmp, 2, [
        (job(tmp, "ep2", QWEN, 2, {"ep": 2}, checkpoint=ckpt), "ref_qwen"),
        # Each block compiled (Inductor), the all-to-all dispatch and combine inside it.
        (job(tmp, "ep2_compiled", QWEN, 2, {"ep": 2}, train={"compile": True}), "ref_qwen"),
    ], ["dp_shard=2 x ep=2"])


@pytest.fixture(scope="module")
def four_ranks(tmp, reference):
    return launch(tmp, 4, [
        (job(tmp, "ep2_fsdp4", QWEN, 4, {"dp_shard": 4, "ep": 2}), "ref_qwen"),
        (job(tmp, "ep4", DEEPSEEK, 4, {"ep": 4}), "ref_deepseek"),
        # Attention (and the dense parts) tensor-parallel, the experts split over ep.
        (job(tmp, "ep2_tp2", QWEN, 2, {"dp_shard": 2, "ep": 2, "tp": 2}), "ref_qwen"),
        # HSDP: two replicas of a 2-rank shard group, the experts split over the shard group.
        (job(tmp, "ep2_hsdp", QWEN, 4, {"dp_replicate": 2, "dp_shard": 2, "ep": 2}), "ref_qwen"),
    ], ["dp_shard=4 x ep=2", "dp_shard=4 x ep=4", "dp_shard=2 x tp=2 x ep=2",
        "dp_replicate=2 x dp_shard=2 x ep=2"])


def assert_same_run(tmp, results: dict, reference: dict, name: str, ref: str) -> None:
    start = results[name]["start_step"]
    got, want = results[name]["losses"], reference[ref][start:]
    assert len(got) == STEPS - start
    assert got == pytest.approx(want, rel=1e-5), name
    ours, theirs = logged(tmp, name), logged(tmp, ref)[-len(got) // 5:]
    assert ours and [r.keys() for r in ours] == [r.keys() for r in theirs]
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), name
    ours, theirs = (load_file(run_dir(tmp, n) / "model.safetensors") for n in (name, ref))
    assert ours.keys() == theirs.keys()
    # AdamW normalises each update: an entry whose gradient is near zero in both runs can
    # differ by a visible fraction of lr from float32 rounding alone (as in test_parallel.py).
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=2e-4, msg=f"{name}: {key}")


@pytest.mark.parametrize("name", ["ep2", "ep2_compiled"])
def test_expert_parallel_on_two_ranks_matches_one_process(tmp, reference, two_ranks, name):
    assert_same_run(tmp, two_ranks, reference, name, "ref_qwen")


@pytest.mark.parametrize("name, ref", [("ep2_fsdp4", "ref_qwen"), ("ep4", "ref_deepseek"),
                                       ("ep2_tp2", "ref_qwen"), ("ep2_hsdp", "ref_qwen")])
def test_expert_parallel_on_four_ranks_matches_one_process(tmp, reference, four_ranks, name, ref):
    assert_same_run(tmp, four_ranks, reference, name, ref)


def test_an_expert_parallel_checkpoint_resumes_and_exports_in_one_process(tmp, reference, two_ranks):
    """The experts saved as two ranks' blocks (DTensors: global names and shapes) load into one
    process, which goes on exactly as the reference; the export of the final checkpoint is the
    reference's export."""
    from kiln.checkpoint.hf_export import export_hf

    seed_run_dir(tmp, "ep2_to_one", "ref_qwen")
    result = train(JobConfig.model_validate(job(tmp, "ep2_to_one", QWEN)),
                   resume=str(checkpoint(tmp, "ep2", 5)))
    assert result.start_step == 5
    assert result.losses == pytest.approx(reference["ref_qwen"][5:], rel=1e-5)
    exports = {}
    for name in ("ep2", "ref_qwen"):
        out = export_hf(str(checkpoint(tmp, name, STEPS)), tmp / f"hf_{name}", dtype="fp32")
        exports[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exports["ep2"].keys() == exports["ref_qwen"].keys()
    assert any(".experts.3." in key for key in exports["ep2"]), sorted(exports["ep2"])  # every expert, the other rank's too
    for key, want in exports["ref_qwen"].items():
        torch.testing.assert_close(exports["ep2"][key], want, rtol=1e-4, atol=2e-4, msg=key)


@pytest.mark.parametrize("parallel, model, needle", [
    ({"ep": 2}, {}, "model.moe is not set"),
    ({"ep": 3}, QWEN, "must divide the data-parallel shard ranks"),
    ({"dp_replicate": 2, "dp_shard": 2, "ep": 4}, QWEN, "must divide the data-parallel shard ranks"),
    ({"ep": 4}, dict(QWEN, moe=dict(QWEN["moe"], n_experts=6)), "must divide model.moe.n_experts=6"),
    ({"ep": 2, "pp": 2, "dp_shard": 2}, QWEN, "parallel.pp=2"),
])
def test_a_bad_expert_parallel_layout_is_a_clear_error(tmp_path, parallel, model, needle):
    cfg = JobConfig.model_validate(job(tmp_path, "bad", model, parallel=parallel))
    with pytest.raises(KilnError, match=needle):
        resolve_layout(cfg.parallel, 4, cfg.model, cfg.data.seq_len, "cpu")
