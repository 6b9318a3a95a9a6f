"""FP8 training via torchao: which layers convert, the clear error without FP8, and the numerics
of a converted model in torchao's emulation (on the CPU)."""

import pytest
import torch

from kiln.config import ModelConfig, OptimConfig, PrecisionConfig
from kiln.errors import KilnError
from kiln.models.transformer import Transformer
from kiln.parallel.float8 import convert_to_float8
from kiln.train.loss import chunked_cross_entropy
from kiln.train.optim import build_optimizer
from kiln.train.precision import Hardware

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

CPU = Hardware("cpu", "test CPU", cpu_arch="x86_64", cpu_capability="AVX512")
H100 = Hardware("cuda", "NVIDIA H100 80GB HBM3", (9, 0))
A100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))
# k/v project to 2 heads x 24 = 48; the MLP's 96 is a multiple of 16; vocab 250 is not.
SHAPE = dict(vocab_size=250, dim=96, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=192,
             max_seq_len=64, tie_embeddings=False)


def fp8(**kw) -> PrecisionConfig:
    return PrecisionConfig(dtype="fp8", fp8_emulate=True, **kw)


def model(seed: int = 0) -> Transformer:
    m = Transformer(ModelConfig(**SHAPE))
    m.init_weights(seed)
    return m


def loss_sum(m: Transformer, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return chunked_cross_entropy(m(tokens, return_hidden=True), m.lm_head, labels)


def test_large_layers_convert_small_ones_and_lm_head_stay():
    m = model()
    names = convert_to_float8(m, fp8(fp8_min_dim=64), CPU)
    converted = {n for n, mod in m.named_modules() if isinstance(mod, Float8Linear)}
    assert set(names) == converted
    # k, v (96 -> 48) are below the minimum; lm_head never converts.
    assert converted == {f"layers.{i}.{n}" for i in range(2)
                         for n in ("attn.q", "attn.o", "mlp.gate", "mlp.up", "mlp.down")}
    assert not isinstance(m.lm_head, Float8Linear)
    # The default minimum (1024) leaves every layer of a small model in bf16.
    assert convert_to_float8(model(), fp8(), CPU) == []


def test_dims_not_multiple_of_16_stay():
    layer = torch.nn.Sequential(torch.nn.Linear(40, 64), torch.nn.Linear(64, 64))
    assert convert_to_float8(layer, fp8(fp8_min_dim=16), CPU) == ["1"]


@pytest.mark.parametrize("hw, words", [(CPU, "auto (here: fp32)"), (A100, "auto (here: bf16)")])
def test_without_fp8_hardware_it_is_a_clear_error(hw, words):
    with pytest.raises(KilnError, match="compute capability 8.9") as err:
        convert_to_float8(model(), PrecisionConfig(dtype="fp8"), hw)
    assert words in str(err.value)


def test_fsdp_all_gather_needs_tensorwise():
    with pytest.raises(KilnError, match="fp8_recipe: tensorwise"):
        convert_to_float8(model(), fp8(), CPU, fsdp_float8_all_gather=True)
    assert convert_to_float8(model(), fp8(fp8_recipe="tensorwise", fp8_min_dim=32), CPU,
                             fsdp_float8_all_gather=True)


def test_conversion_works_on_the_meta_device():
    with torch.device("meta"):
        m = Transformer(ModelConfig(**SHAPE))
    assert convert_to_float8(m, fp8(fp8_min_dim=32), H100)
    assert m.lm_head.weight.is_meta


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_converted_model_is_close_to_the_high_precision_one(recipe):
    reference, converted = model(), model()
    convert_to_float8(converted, fp8(fp8_recipe=recipe, fp8_min_dim=32), CPU)
    tokens = torch.randint(0, 250, (4, 48), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 250, (4, 48), generator=torch.Generator().manual_seed(2))
    want, got = reference(tokens), converted(tokens)
    assert not torch.equal(want, got)  # the fp8 casts are really there
    cosine = torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0)
    # Measured with every linear layer in fp8: 0.9997 and 0.044.
    assert cosine > 0.998, cosine
    assert (want - got).abs().max() < 0.1 * want.abs().max()
    # Gradients through the fp8 backward (e5m2 grad outputs or e4m3 rowwise) agree too.
    for m in (reference, converted):
        loss_sum(m, tokens, targets).backward()
    for (name, a), (_, b) in zip(reference.named_parameters(), converted.named_parameters()):
        cos = torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0)
        assert cos > 0.98, (name, cos)


def test_fp8_model_trains():
    m = model()
    convert_to_float8(m, fp8(fp8_min_dim=32), CPU)
    opt = build_optimizer(m, OptimConfig(lr=1e-2, weight_decay=0.0))
    tokens = torch.randint(0, 250, (8, 33), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(8):
        loss = loss_sum(m, tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_every_converted_layer_runs_in_the_forward():
    m = model()
    names = convert_to_float8(m, fp8(fp8_min_dim=32), CPU)
    ran = set()
    for name in names:
        m.get_submodule(name).register_forward_hook(lambda mod, i, o, name=name: ran.add(name))
    m(torch.zeros(1, 8, dtype=torch.long))
    assert ran == set(names)
