"""The mixture-of-experts block: dispatch against a per-token reference, grouped against looped
expert compute, balance (aux-free bias, losses, metrics), recompute, FLOPs, training."""

import json
import math

import pytest
import torch
from torch.distributed._composable import checkpoint
from torch.utils.flop_counter import FlopCounterMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import tiny_job
from kiln.config import ModelConfig, load_config
from kiln.data.batch import Batch
from kiln.errors import KilnError
from kiln.models.moe import MoE, grouped_mm_works, moe_layers, router_z_loss, update_expert_biases
from kiln.models.transformer import Transformer, count_parameters, flops_per_token
from kiln.tasks.pretrain import Pretrain
from kiln.train.build import build
from kiln.train.metrics import moe_metrics
from kiln.train.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread():
    # Small ops (index_add, softmax) on 2 threads of an oversubscribed machine wait on each
    # other for tens of milliseconds; one thread keeps these tests in seconds.
    torch.set_num_threads(1)


def model_cfg(**moe) -> ModelConfig:
    return ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, intermediate_size=64,
                       max_seq_len=64, moe={"n_experts": 4, "top_k": 2, "intermediate_size": 16, **moe})


def moe_block(seed=0, **moe) -> MoE:
    torch.manual_seed(seed)
    block = MoE(model_cfg(**moe))
    torch.nn.init.normal_(block.router.weight, std=0.5)  # decisive routing, no near-ties
    return block


def reference(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: the weighted sum of its top-k experts (+ shared), no sorting."""
    h = x.reshape(-1, x.shape[-1])
    _, experts, weights = block.route(block.router(h).float())
    ex = block.experts
    rows = []
    for t in range(h.shape[0]):
        y = sum(w * (ex.down[e] @ (torch.nn.functional.silu(ex.gate[e] @ h[t]) * (ex.up[e] @ h[t])))
                for e, w in zip(experts[t].tolist(), weights[t]))
        rows.append(y + (block.shared(h[t]) if block.shared is not None else 0))
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("moe", [dict(), dict(gating="sigmoid", n_shared_experts=1),
                                 dict(norm_topk_prob=False, top_k=3)])
def test_dispatch_gives_each_token_its_experts_weighted_sum(moe):
    block = moe_block(**moe)
    block.experts.compute = "loop"
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(block(x), reference(block, x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not grouped_mm_works("cpu", torch.float32),
                    reason="torch._grouped_mm does not run on this CPU build")
@pytest.mark.parametrize("moe", [dict(), dict(gating="sigmoid", n_shared_experts=1)])
def test_grouped_and_looped_experts_give_same_outputs_and_gradients(moe):
    x = torch.randn(3, 11, 32)
    results = []
    for compute in ("grouped", "loop"):
        block = moe_block(**moe)
        block.experts.compute = compute
        xi = x.clone().requires_grad_()
        y = block(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y, xi.grad] + [p.grad for p in block.parameters()])
    for grouped, looped in zip(*results):
        torch.testing.assert_close(grouped, looped, atol=1e-5, rtol=1e-5)


def test_aux_free_bias_moves_load_toward_balance():
    block = moe_block(bias_update_rate=0.005).train()
    # Skew the router: inputs share a direction that expert 0's row points along, so expert 0
    # is among every token's top 2 (its load twice the mean).
    offset = torch.ones(32)
    with torch.no_grad():
        block.router.weight.mul_(0.2)[0] += 0.1 * offset
    x = torch.randn(4, 64, 32) + offset

    def imbalance(steps: int) -> float:
        """max / mean tokens per expert over `steps` forwards, each followed by a bias update."""
        total = torch.zeros(4, dtype=torch.int64)
        for _ in range(steps):
            block(x)
            total += block.load_step
            update_expert_biases(block)
        return (total.max() / total.float().mean()).item()

    block.expert_bias.zero_()
    assert imbalance(1) == pytest.approx(2.0)
    imbalance(200)
    assert imbalance(20) < 1.15
    assert block.expert_bias[0] < 0 < block.expert_bias[1:].min()  # the busy expert pushed down


def test_recompute_under_activation_checkpointing_counts_once_same_gradients():
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = Batch(tokens[:, :-1], tokens[:, 1:])
    runs = []
    for ac in (False, True):
        model = Transformer(model_cfg(aux_loss_coef=0.1, router_z_loss_coef=0.01))
        model.init_weights(0)
        if ac:
            for block in model.layers.values():
                checkpoint(block)
        Pretrain().loss_sum(model, batch).backward()
        runs.append(([m.load_window.clone() for m in moe_layers(model).values()],
                     [p.grad for p in model.parameters()]))
    (loads, grads), (ac_loads, ac_grads) = runs
    assert all(torch.equal(a, b) for a, b in zip(loads, ac_loads))
    assert all(load.sum() == 2 * 16 * 2 for load in loads)  # tokens x top_k, once
    for a, b in zip(grads, ac_grads):
        torch.testing.assert_close(a, b)


def test_z_loss_is_the_mean_squared_logsumexp_of_all_router_logits():
    model = Transformer(model_cfg())
    model.init_weights(0)
    logits = []
    for m in moe_layers(model).values():
        m.router.register_forward_hook(lambda mod, args, out: logits.append(out.detach()))
    model(torch.randint(0, 256, (2, 16)))
    expected = torch.cat(logits).logsumexp(-1).square().mean()
    stats = [m.stats for m in moe_layers(model).values()]
    torch.testing.assert_close(router_z_loss(stats), expected)


def test_flops_per_token_counts_active_experts_only():
    cfg = model_cfg(first_k_dense=1)
    model = Transformer(cfg)
    for m in moe_layers(model).values():
        m.experts.compute = "loop"  # plain matmuls the counter sees
    seq = 64
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, cfg.vocab_size, (1, seq))).sum().backward()
    assert counter.get_total_flops() / seq == pytest.approx(flops_per_token(cfg, seq), rel=0.01)
    assert count_parameters(cfg, active=True) < count_parameters(cfg)


def test_moe_config_errors_are_clear(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("model:\n  moe:\n    n_experts: 4\n")
    with pytest.raises(KilnError, match="'model.moe'.*top_k=5 exceeds n_experts=4"):
        load_config(job, ["model.moe.top_k=5"])
    with pytest.raises(KilnError, match="first_k_dense=4 leaves no MoE layer"):
        load_config(job, ["model.moe.first_k_dense=4"])


def test_tiny_moe_trains_with_aux_free_bias_and_metrics(tmp_path):
    cfg = tiny_job(tmp_path, model={"moe": dict(n_experts=4, top_k=2, intermediate_size=32,
                                                bias_update_rate=0.01, router_z_loss_coef=1e-3)},
                   train={"max_steps": 40, "eval_interval": 20, "activation_checkpointing": True,
                          "sample_tokens": 0, "num_threads": 1})
    trainer = Trainer(build(cfg))
    result = trainer.fit()
    first, last = result.val_losses[0][1], result.val_losses[-1][1]
    assert first == pytest.approx(math.log(512), rel=0.05)
    assert last < 0.9 * first
    # The trainer read (and reset) the routing figures at every log line: they are in the log.
    lines = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in lines if "loss" in r]
    assert [r["step"] for r in logged] == [20, 40]
    record = logged[-1]
    assert {"moe/load/0", "moe/load/1", "moe/load_max", "moe/aux_loss", "moe/z_loss",
            "moe/bias_min", "moe/bias_max"} <= set(record)
    assert record["moe/load_max"] >= 1.0 and record["moe/bias_min"] < 0 < record["moe/bias_max"]
    assert 1.5 < record["moe/aux_loss"] < 4.0  # top_k (2) when balanced, up to 8
    assert all(m.load_window.sum() == 0 for m in moe_layers(trainer.model).values())  # read once
