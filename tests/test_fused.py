"""The fused autograd functions against the plain PyTorch formulas they replace: values and gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.models.fused import rms_norm, rope
from kiln.data.batch import Batch
from kiln.models.transformer import Transformer
from kiln.tasks.pretrain import Pretrain
from kiln.train.loss import chunked_cross_entropy, cross_entropy_sum, linear_cross_entropy


def leaf(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def grads_of(fn, *inputs, seed=9):
    out = fn(*inputs)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    (out * weights).sum().backward()  # a random direction, so every output element counts
    result = out.detach(), [i.grad.clone() for i in inputs]
    for i in inputs:
        i.grad = None
    return result


@pytest.mark.parametrize("shape", [(2, 5, 16), (2, 5, 3, 8)])  # residual stream; per-head (Qwen3)
def test_rms_norm_matches_torch_rmsnorm_values_and_gradients(shape):
    x, w = leaf(*shape), leaf(shape[-1], seed=1)
    expected, (gx, gw) = grads_of(lambda x, w: F.rms_norm(x, (shape[-1],), w, 1e-5), x, w)
    got, (fx, fw) = grads_of(lambda x, w: rms_norm(x, w, 1e-5), x, w)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fx, gx)
    torch.testing.assert_close(fw, gw)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))


def rotate_half_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)


def test_rope_matches_rotate_half_reference_values_and_gradients():
    x = leaf(2, 6, 3, 8)  # (batch, seq, heads, head_dim)
    angles = torch.rand(6, 1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 6
    cos, sin = angles.cos(), angles.sin()
    expected, (gx,) = grads_of(lambda x: rotate_half_reference(x, cos, sin), x)
    got, (fx,) = grads_of(lambda x: rope(x, cos, sin), x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fx, gx)
    assert torch.autograd.gradcheck(lambda x: rope(x, cos, sin), (x,))


def ce_reference(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float().flatten(0, 1), targets.flatten(),
                           ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_elements", [2**22, 3 * 50])  # one chunk; many, the last partial
def test_linear_cross_entropy_matches_reference_with_ignored_targets(chunk_elements):
    hidden, weight = leaf(2, 70, 16, dtype=torch.float32), leaf(50, 16, dtype=torch.float32, seed=1)
    targets = torch.randint(0, 50, (2, 70), generator=torch.Generator().manual_seed(3))
    targets[0, :9] = -100
    targets[1, -1] = -100

    def fused(h, w):
        return linear_cross_entropy(h, w, targets, chunk_elements=chunk_elements)

    expected, (gh, gw) = grads_of(lambda h, w: ce_reference(h, w, targets), hidden, weight)
    got, (fh, fw) = grads_of(fused, hidden, weight)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(fh, gh)
    torch.testing.assert_close(fw, gw)
    assert fh[0, :9].abs().max() == 0  # ignored positions get no gradient
    with torch.no_grad():
        torch.testing.assert_close(fused(hidden, weight), expected)


def test_linear_cross_entropy_does_no_gradient_work_under_no_grad():
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight = leaf(3, 40, 16, dtype=torch.float32), leaf(50, 16, dtype=torch.float32, seed=1)
    targets = torch.randint(0, 50, (3, 40), generator=torch.Generator().manual_seed(3))
    logits_flops = 2 * 3 * 40 * 16 * 50
    for grad_enabled, expected in ((False, logits_flops), (True, 3 * logits_flops)):
        with torch.set_grad_enabled(grad_enabled), FlopCounterMode(display=False) as counter:
            linear_cross_entropy(hidden, weight, targets, chunk_elements=50 * 32)
        assert counter.get_total_flops() == expected


def test_linear_cross_entropy_under_bf16_autocast_is_close_and_keeps_fp32_grads():
    hidden, weight = leaf(4, 64, 32, dtype=torch.float32), leaf(300, 32, dtype=torch.float32, seed=1)
    targets = torch.randint(0, 300, (4, 64), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, (gh, gw) = grads_of(lambda h, w: ce_reference(h, w, targets), hidden, weight)
        got, (fh, fw) = grads_of(lambda h, w: linear_cross_entropy(h, w, targets, chunk_elements=3000),
                                 hidden, weight)
    assert got.dtype == torch.float32 and fh.dtype == fw.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=0)
    for fused, reference in ((fh, gh), (fw, gw)):  # bf16 rounding: compare as vectors
        assert (fused - reference).norm() < 0.02 * reference.norm()


class ScaledHead(torch.nn.Linear):
    """A head whose forward is not nn.Linear's (as an adapter's would be): the loss must call it.
    Counts the rows it is given."""

    rows = 0

    def forward(self, x):
        self.rows += x.shape[0]
        return super().forward(x) * 1.5


@pytest.mark.parametrize("chunk_elements", [2**22, 3 * 50])
@pytest.mark.parametrize("head_type", [ScaledHead, torch.nn.Linear])
@pytest.mark.parametrize("targets_only", [False, True])
def test_chunked_loss_calls_a_wrapped_head_as_a_module(chunk_elements, head_type, targets_only):
    # targets_only: the head runs on the target rows alone (fine-tuning's replies), same result.
    hidden = leaf(2, 70, 16, dtype=torch.float32)
    head = head_type(16, 50, bias=False)
    targets = torch.randint(0, 50, (2, 70), generator=torch.Generator().manual_seed(3))
    targets[0, :9] = -100
    if targets_only:
        targets[:, 20:61] = -100  # prompts
    expected = cross_entropy_sum(head(hidden), targets)
    expected.backward()
    gh, gw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    head.rows = 0
    got = chunked_cross_entropy(hidden, head, targets, chunk_elements=chunk_elements,
                                targets_only=targets_only)
    if head_type is ScaledHead:  # the forward's rows: all of them, or the targets' alone
        assert head.rows == (int((targets != -100).sum()) if targets_only else targets.numel())
    got.backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(hidden.grad, gh)
    torch.testing.assert_close(head.weight.grad, gw)


@pytest.mark.parametrize("extra", [{}, {"qkv_bias": True, "tie_embeddings": True},
                                   {"qk_norm": True, "head_dim": 32}])
def test_model_loss_with_targets_matches_logits_then_cross_entropy(extra):
    cfg = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      intermediate_size=96, max_seq_len=64, **extra)
    model = Transformer(cfg)
    model.init_weights(0)
    with torch.no_grad():  # non-trivial biases and norm weights, so their gradients are tested
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    targets[:, -1] = -100
    ce_reference_loss = cross_entropy_sum(model(tokens), targets)
    ce_reference_loss.backward()
    fused_loss = Pretrain().loss_sum(twin, Batch(tokens, targets))
    fused_loss.backward()
    torch.testing.assert_close(fused_loss, ce_reference_loss)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
