"""The training step and loop: accumulation, checkpointing, determinism, a loss that falls."""

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_job
from kiln.config import JobConfig, ModelConfig, ScheduleConfig, TrainConfig
from kiln.models.transformer import Transformer
from kiln.parallel import parallelize
from kiln.train.schedule import lr_multiplier
from kiln.data.batch import Batch
from kiln.tasks.pretrain import Pretrain
from kiln.train.loss import cross_entropy_sum
from kiln.train.trainer import train, train_step

CFG = ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=160, max_seq_len=64)


def tiny_model(seed=0) -> Transformer:
    model = Transformer(CFG)
    model.init_weights(seed)
    return model


def batch(n=8, t=32, seed=1):
    tokens = torch.randint(0, CFG.vocab_size, (n, t + 1), generator=torch.Generator().manual_seed(seed))
    targets = tokens[:, 1:].clone()
    targets[0, :5] = -100  # some ignored targets: normalisation must count only real ones
    return tokens[:, :-1], targets


def test_grad_accumulation_matches_one_big_batch():
    x, y = batch()
    updated = []
    for micro in (8, 2):
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        batches = [Batch(x[i:i + micro], y[i:i + micro]) for i in range(0, 8, micro)]
        loss, _ = train_step(model, opt, Pretrain().loss_sum, batches)
        updated.append((loss.item(), model.state_dict()))
    (loss_one, one), (loss_four, four) = updated
    assert loss_one == pytest.approx(loss_four, rel=1e-6)
    for name in one:
        torch.testing.assert_close(one[name], four[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(one["layers.0.mlp.up.weight"], tiny_model().state_dict()["layers.0.mlp.up.weight"])


def grads(model, x, y):
    model.zero_grad()
    cross_entropy_sum(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_gives_same_gradients():
    x, y = batch()
    plain = tiny_model()
    checkpointed = parallelize(copy.deepcopy(plain), None, JobConfig(train=TrainConfig(activation_checkpointing=True)))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    expected, got = grads(plain, x, y), grads(checkpointed, x, y)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_schedules():
    cos = lr_multiplier(ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.1), 110)
    assert cos(0) < cos(5) < cos(9) <= 1.0
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55) and cos(110) == pytest.approx(0.1)
    wsd = lr_multiplier(ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.0), 100)
    assert wsd(10) == wsd(79) == 1.0
    assert wsd(90) == pytest.approx(0.5) and wsd(100) == pytest.approx(0.0)


def test_training_run_loss_falls_and_writes_run_dir(tmp_path):
    cfg = tiny_job(tmp_path, train={"max_steps": 100, "eval_interval": 50})
    result = train(cfg)
    first, last = result.val_losses[0][1], result.val_losses[-1][1]
    assert first == pytest.approx(math.log(512), rel=0.05)  # untrained: ~uniform over the vocab
    assert last < 0.85 * first
    run = cfg.run_dir
    assert {"config.yaml", "tokenizer.json", "metrics.jsonl", "model.safetensors"} <= {p.name for p in run.iterdir()}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [r for r in records if "loss" in r]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb"} <= set(train_lines[0])
    assert [r["step"] for r in train_lines] == [20, 40, 60, 80, 100]
    assert any("val_ppl" in r for r in records)
    weights = load_file(run / "model.safetensors")
    assert weights["layers.1.mlp.down.weight"].shape == (64, 160)
    assert result.sample


def test_same_seed_same_run_and_bf16_trains(tmp_path):
    a = train(tiny_job(tmp_path / "a", train={"max_steps": 8, "sample_tokens": 0}))
    b = train(tiny_job(tmp_path / "b", train={"max_steps": 8, "sample_tokens": 0}))
    assert a.losses == b.losses
    wa = load_file(tmp_path / "a/runs/t/model.safetensors")
    wb = load_file(tmp_path / "b/runs/t/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = train(tiny_job(tmp_path / "c", train={"max_steps": 8, "seed": 1, "sample_tokens": 0}))
    assert c.losses != a.losses
    bf16 = train(tiny_job(tmp_path / "d", train={"max_steps": 8, "sample_tokens": 0},
                          precision={"dtype": "bf16"}))
    assert bf16.losses[-1] < bf16.losses[0]
    assert bf16.losses != a.losses
    assert load_file(tmp_path / "d/runs/t/model.safetensors")["embed.weight"].dtype == torch.float32


def test_token_budget_stops_the_run(tmp_path):
    result = train(tiny_job(tmp_path, train={"max_steps": None, "max_tokens": 5 * 16 * 32, "sample_tokens": 0}))
    assert result.steps == 5
