"""LoRA, DoRA and QLoRA under FSDP2, LoRA and DoRA under tensor parallel (and LoRA under both),
LoRA over two pipeline stages: `torchrun -m kiln train` over 2 or 4 ranks (gloo) gives the
single-process losses and adapter, the base sharded (or split by layers) and frozen (QLoRA's
as NF4 codes and scales, quantised whole and then split, so both runs hold the same base)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import torchrun
from test_peft import base, hf_base, job  # noqa: F401  (base: the module-scoped Hugging Face base fixture)
from kiln.errors import KilnError
from kiln.launch.layout import Layout
from kiln.models.transformer import Transformer
from kiln.peft import apply_tuning, check_layout
from kiln.train.trainer import train


ALL_LINEAR = ["q", "k", "v", "o", "gate", "up", "down"]
CASES = {
    # Adapters on a tied (sharded, frozen) embedding and lm_head too, and LoRA+'s own LR for B.
    "lora-fsdp2": ("lora", {"dp_shard": 2}, True,
                   {"target_modules": ALL_LINEAR + ["lm_head", "embed"], "loraplus_lr_ratio": 4.0}),
    "qlora-fsdp2": ("qlora", {"dp_shard": 2}, False, {}),
    # DoRA's magnitude divides by the norm of the whole (all-gathered) weight plus B @ A.
    "dora-fsdp2": ("dora", {"dp_shard": 2}, False, {"target_modules": ALL_LINEAR + ["lm_head"]}),
    # Tensor parallel: A whole and B split by rows in q/k/v/gate/up, A split by columns in o/down.
    "lora-tp": ("lora", {"tp": 2}, False, {"target_modules": ALL_LINEAR + ["lm_head", "embed"]}),
    # And FSDP2 over 2 ranks on top (4 processes).
    "lora-fsdp2-tp": ("lora", {"dp_shard": 2, "tp": 2}, False,
                      {"target_modules": ALL_LINEAR + ["lm_head", "embed"]}),
    # DoRA's row norms: local rows in q/k/v/gate/up, summed over ranks' columns in o/down.
    "dora-tp": ("dora", {"tp": 2}, False, {}),
    # Two stages, one layer each: the embedding's adapter on the first, lm_head's on the last.
    "lora-pp": ("lora", {"pp": 2}, False, {"target_modules": ALL_LINEAR + ["lm_head", "embed"]}),
}


@pytest.mark.parametrize("case", CASES)
def test_adapter_over_ranks_equals_one_process(tmp_path, base, case):  # noqa: F811
    method, parallel, tie, peft = CASES[case]
    # The same global batch of 8 sequences: 2 data-parallel ranks x 4, or 2 micro-batches of 4
    # (one process, tensor parallel, pipeline stages).
    common = dict(train={"global_batch_size": 8, "num_threads": 1}, checkpoint={"interval": None},
                  peft=peft)
    if tie:
        base = hf_base(tmp_path / "tied", tie=True)
    single = job(tmp_path / "single", base, method, steps=4, **common)
    reference = train(single)
    sharded = job(tmp_path / "sharded", base, method, steps=4, parallel=parallel, **common)
    config = tmp_path / "sharded.yaml"
    config.write_text(sharded.to_yaml())
    torchrun(["-m", "kiln", "train", str(config)], nproc=math.prod(parallel.values()), timeout=300)
    lines = [json.loads(line) for line in (sharded.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    want = [reference.losses[i - 1] for i in (3, 4)]  # logged every 3 steps and at the end
    assert losses == pytest.approx(want, abs=1e-5)
    got, expected = load_file(sharded.run_dir / "model.safetensors"), load_file(single.run_dir / "model.safetensors")
    assert got.keys() == expected.keys()  # the adapter alone, gathered from both ranks
    # Adam turns float-order differences in near-zero gradients into steps of up to lr (1e-2):
    # equal to well under one step.
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-3, rtol=0)


def test_a_compiled_tensor_parallel_adapter_checkpoint_resumes_in_one_process(tmp_path, base):  # noqa: F811
    """LoRA at tp=2 with activation checkpointing and compiled blocks, checkpointed at step 2:
    the adapter and its optimizer state, split by the TP plan, load into one (eager) process,
    which goes on with the losses of an uninterrupted one-process run."""
    common = dict(train={"global_batch_size": 8, "num_threads": 1, "log_interval": 1,
                         "activation_checkpointing": True}, checkpoint={"interval": 2})
    reference = train(job(tmp_path / "single", base, steps=4, **common))
    split = job(tmp_path / "tp", base, steps=4, parallel={"tp": 2}, **{
        **common, "train": {**common["train"], "compile": True}})
    config = tmp_path / "tp.yaml"
    config.write_text(split.to_yaml())
    torchrun(["-m", "kiln", "train", str(config)], timeout=300)
    resumed = train(job(tmp_path / "resumed", base, steps=4, **common),
                    resume=str(split.run_dir / "checkpoints" / "step-000002"))
    assert resumed.start_step == 2
    assert resumed.losses == pytest.approx(reference.losses[2:], abs=1e-5)


def test_qlora_layouts_it_cannot_shard_are_refused(tmp_path, base):  # noqa: F811
    cfg = job(tmp_path, base, "qlora")
    with pytest.raises(KilnError, match=r"qlora with pp=2.*not wired in"):
        check_layout(cfg, Layout(pp=2))
    with pytest.raises(KilnError, match=r"qlora with dp_replicate=2 x dp_shard=2.*not wired in"):
        check_layout(cfg, Layout(dp_replicate=2, dp_shard=2))
    with pytest.raises(KilnError, match=r"qlora with parallel.tp=2: splitting an NF4 base"):
        check_layout(job(tmp_path, base, "qlora", parallel={"tp": 2}), Layout(tp=2))
    check_layout(cfg, Layout(dp_shard=4))  # FSDP2 alone is what runs
    # Three ranks cannot each get whole rows of the 64-row q projection.
    with torch.device("meta"):
        model = Transformer(cfg.model)
    with pytest.raises(KilnError, match=r"dp_shard=3: layers\.0\.attn\.q\.weight \[64, 64\] does not split"):
        apply_tuning(model, cfg, shards=3)
