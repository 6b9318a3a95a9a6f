"""What only a GPU can show: the fused kernels, bf16 autocast, compile, checkpoints and fp8 on
CUDA. Skipped without CUDA (tests/conftest.py); bench/gpu.sh runs them on the GPU machine."""

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_job
from kiln.config import ModelConfig, PrecisionConfig
from kiln.models.fused import rms_norm, rope
from kiln.models.transformer import Transformer
from kiln.train.loss import linear_cross_entropy
from kiln.train.metrics import resolve_peak
from kiln.train.precision import detect_hardware, resolve_precision
from kiln.train.trainer import train

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(CUDA).requires_grad_()


def value_and_grads(fn, *inputs):
    out = fn(*inputs)
    direction = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out)
    grads = torch.autograd.grad((out * direction).sum(), inputs)
    return out.detach(), grads


def assert_same(fused, reference, rtol=1e-4, atol=1e-5):
    (out, grads), (ref_out, ref_grads) = fused, reference
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol)


def test_fused_kernels_match_their_references_on_cuda():
    x, w = randn(4, 33, 64), randn(64, seed=1)
    assert_same(value_and_grads(lambda x, w: rms_norm(x, w, 1e-5), x, w),
                value_and_grads(lambda x, w: F.rms_norm(x, (64,), w, 1e-5), x, w))
    q = randn(2, 17, 4, 32, seed=2)
    angles = torch.rand(17, 1, 16, generator=torch.Generator().manual_seed(3)).to(CUDA) * 6
    cos, sin = angles.cos(), angles.sin()

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)

    assert_same(value_and_grads(lambda q: rope(q, cos, sin), q), value_and_grads(rotate_half, q))
    hidden, weight = randn(2, 70, 64, seed=4), randn(1000, 64, seed=5)
    targets = torch.randint(0, 1000, (2, 70), generator=torch.Generator().manual_seed(6)).to(CUDA)
    targets[0, :5] = -100

    def reference(h, w):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum")

    assert_same(value_and_grads(lambda h, w: linear_cross_entropy(h, w, targets, chunk_elements=9000),
                                hidden, weight),
                value_and_grads(reference, hidden, weight), rtol=1e-4, atol=1e-3)


def test_precision_and_peak_on_this_gpu():
    hw = detect_hardware(CUDA)
    p = resolve_precision(PrecisionConfig(), hw)
    expected = "bf16" if torch.cuda.get_device_capability() >= (8, 0) else "fp16"
    assert p.dtype == expected, p.reason
    peak = resolve_peak(CUDA, p.matmul_dtype)
    assert peak.flops > 1e13, peak


def test_bf16_autocast_model_is_close_to_fp32():
    cfg = ModelConfig(vocab_size=1000, dim=256, n_layers=2, n_heads=8, n_kv_heads=4,
                      intermediate_size=512, max_seq_len=128)
    model = Transformer(cfg).to(CUDA)
    model.init_weights(0)
    tokens = torch.randint(0, 1000, (4, 128), generator=torch.Generator().manual_seed(1)).to(CUDA)
    fp32 = model(tokens)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = model(tokens)
    assert bf16.dtype == torch.bfloat16
    cosine = F.cosine_similarity(fp32.flatten(), bf16.float().flatten(), dim=0)
    assert cosine > 0.999, cosine


def losses_of(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if "loss" in x]


def cuda_job(tmp_path, **train_cfg):
    return tiny_job(tmp_path, train={"device": "cuda", "sample_tokens": 0, "log_interval": 5,
                                     "eval_interval": 1000, **train_cfg},
                    metrics={"peak_tflops": None})


def test_training_with_compile_and_activation_checkpointing_on_cuda(tmp_path):
    eager = train(cuda_job(tmp_path / "eager", max_steps=30))
    compiled = train(cuda_job(tmp_path / "compiled", max_steps=30, compile=True,
                              activation_checkpointing=True))
    for result in (eager, compiled):
        assert result.losses[-1] < 0.9 * result.losses[0]
    # Same seed, same data: compile and recompute change rounding, not the run.
    assert abs(compiled.losses[-1] - eager.losses[-1]) < 0.05 * eager.losses[-1]
    lines = (tmp_path / "compiled/runs/t/metrics.jsonl").read_text().splitlines()
    assert all(0 < json.loads(x)["mfu"] <= 1 for x in lines if '"mfu"' in x)


def test_checkpoint_resume_on_cuda_continues_the_run(tmp_path):
    ckpt = {"interval": 5, "keep_last": None}
    whole = train(tiny_job(tmp_path / "whole", train={"device": "cuda", "max_steps": 10,
                                                     "sample_tokens": 0, "eval_interval": 1000},
                           checkpoint=ckpt))
    part = tiny_job(tmp_path / "part", train={"device": "cuda", "max_steps": 5,
                                              "sample_tokens": 0, "eval_interval": 1000},
                    checkpoint=ckpt)
    train(part)
    resumed = train(part.model_copy(update={"train": part.train.model_copy(update={"max_steps": 10})}))
    assert resumed.start_step == 5
    torch.testing.assert_close(resumed.losses, whole.losses[5:], rtol=1e-3, atol=1e-3)


def test_fp8_on_cuda_is_close_to_bf16_and_compiles():
    pytest.importorskip("torchao")
    from kiln.parallel.float8 import convert_to_float8

    hw = detect_hardware(CUDA)
    if hw.cuda_capability < (8, 9):
        pytest.skip("no FP8 tensor cores")
    cfg = ModelConfig(vocab_size=1024, dim=1024, n_layers=2, n_heads=8, n_kv_heads=8,
                      intermediate_size=2048, max_seq_len=256)
    reference = Transformer(cfg).to(CUDA)
    reference.init_weights(0)
    converted = Transformer(cfg).to(CUDA)
    converted.load_state_dict(reference.state_dict())
    names = convert_to_float8(converted, PrecisionConfig(dtype="fp8"), hw)
    assert names
    tokens = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = reference(tokens).float()
        got = converted(tokens).float()
        compiled = torch.compile(converted)(tokens).float()
    for out in (got, compiled):
        cosine = F.cosine_similarity(want.flatten(), out.flatten(), dim=0)
        assert cosine > 0.99, cosine
