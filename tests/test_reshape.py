"""The model's shape lets layouts and tuning methods apply from outside: tensor parallel plans,
FSDP2 resharding, swapped-in modules (adapters), pipeline stages, global token counts."""

import json

import pytest
import torch
from torch import nn

from conftest import ROOT, torchrun
from kiln.config import ModelConfig
from kiln.models.transformer import Transformer

CFG = ModelConfig(vocab_size=96, dim=64, n_layers=4, n_heads=4, n_kv_heads=2,
                  intermediate_size=160, max_seq_len=64)


def model(seed=0) -> Transformer:
    m = Transformer(CFG)
    m.init_weights(seed)
    return m


def tokens(seed=1):
    return torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


class Doubled(nn.Module):
    """What an adapter is: a module standing in for a linear layer, with its own forward."""

    def __init__(self, inner: nn.Linear):
        super().__init__()
        self.inner = inner
        self.weight = inner.weight  # what code that reads `.weight` directly would see

    def forward(self, x):
        return 2 * self.inner(x)


@pytest.mark.parametrize("path", ["attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"])
def test_a_module_swapped_in_for_a_linear_layer_changes_the_logits(path):
    m = model()
    with torch.no_grad():
        before = m(tokens())
        parent, name = m.layers["1"].get_submodule(path.split(".")[0]), path.split(".")[1]
        setattr(parent, name, Doubled(getattr(parent, name)))
        after = m(tokens())
    assert not torch.allclose(before, after, atol=1e-4)


def test_a_pipeline_stage_made_by_dropping_layers_keeps_names_and_composes():
    full, first, second = model(), model(), model()
    for stage, keep in ((first, {"0", "1"}), (second, {"2", "3"})):
        for key in [k for k in stage.layers if k not in keep]:
            del stage.layers[key]
    first.norm = first.lm_head = None
    second.embed = None
    full_names = {n for n, _ in full.named_parameters()}
    names = [{n for n, _ in s.named_parameters()} for s in (first, second)]
    assert names[0] | names[1] == full_names and not names[0] & names[1]
    assert "layers.2.attn.q.weight" in names[1]  # not renumbered to layers.0
    with torch.no_grad():
        torch.testing.assert_close(second(first(tokens())), full(tokens()))


def test_tensor_parallel_fsdp_and_global_token_count_on_two_ranks(tmp_path):
    result = tmp_path / "result.json"
    torchrun([str(ROOT / "tests/workers/reshape_worker.py"), str(result)])
    out = json.loads(result.read_text())
    # Tensor parallel: the plan applies (weights are DTensors) and gives the unsharded block.
    assert out["tp_sharded"]
    assert out["tp_max_diff"] < 1e-5 and out["tp_grad_max_diff"] < 1e-5
    # FSDP2 between forward and backward: every weight that autograd kept for backward is the
    # gathered parameter whose storage FSDP freed after the block's forward; no copy is alive.
    # (A concatenated q|k|v or gate|up weight would be a live copy of an unsharded weight.)
    assert out["fsdp_weight_copies_alive"] == []
    # Global token count: unequal masks on two ranks give the one-process update.
    assert out["dp_loss"] == pytest.approx(out["single_loss"], rel=1e-6)
    assert out["dp_weight_max_diff"] < 1e-6 and out["dp_changed"] > 1e-4
