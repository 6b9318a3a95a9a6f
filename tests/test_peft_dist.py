"""LoRA and QLoRA under FSDP2: `torchrun -m kiln train` over 2 ranks (gloo) gives the
single-process losses and adapter, the base sharded and frozen on both ranks (QLoRA's as NF4
codes and scales, quantised whole and then split, so both runs hold the same base)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import torchrun
from test_peft import base, job  # noqa: F401  (base: the module-scoped Hugging Face base fixture)
from kiln.train.trainer import train


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapter_over_two_fsdp2_ranks_equals_one_process(tmp_path, base, method):  # noqa: F811
    # The same global batch of 8 sequences: 2 ranks x 4, or 1 process x 2 micro-batches of 4.
    common = dict(train={"global_batch_size": 8, "num_threads": 1}, checkpoint={"interval": None})
    single = job(tmp_path / "single", base, method, steps=4, **common)
    reference = train(single)
    sharded = job(tmp_path / "sharded", base, method, steps=4, parallel={"dp_shard": 2}, **common)
    config = tmp_path / "sharded.yaml"
    config.write_text(sharded.to_yaml())
    torchrun(["-m", "kiln", "train", str(config)], timeout=300)
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
