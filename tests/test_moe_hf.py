"""Mixtral and Qwen3-MoE against `transformers`: weights through the import path, logits, the
auxiliary loss, the whole training loss, export of a trained run, preset sizes."""

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_model
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from conftest import tiny_job
from kiln.checkpoint.hf_import import job_yaml, load_hf_weights, read_hf_config
from kiln.cli import main
from kiln.config import ModelConfig
from kiln.data.batch import IGNORE_INDEX, Batch
from kiln.errors import KilnError
from kiln.models.hf import (from_hf_state_dict, hf_config_from_model, model_config_from_hf,
                            to_hf_state_dict)
from kiln.models.moe import load_balancing_loss, moe_layers
from kiln.models.transformer import Transformer, count_parameters
from kiln.tasks.pretrain import Pretrain
from kiln.train.trainer import train

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
            router_aux_loss_coef=0.1)
FAMILIES = {
    "mixtral": (transformers.MixtralConfig, dict(intermediate_size=32, num_local_experts=4,
                                                 rope_theta=1e6)),
    # The first layer dense, the top-k weights not renormalised: the other paths.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=4, head_dim=32,
        mlp_only_layers=[0], norm_topk_prob=False, rope_theta=1e6)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # see tests/test_moe.py: 2 threads crawl on a loaded machine


def hf_directory(family: str, path) -> transformers.PreTrainedModel:
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = config_cls(**TINY, **extra, attn_implementation="eager")
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # HF ones norms and zeros routers; make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return model.eval()


def ours_from(path) -> Transformer:
    model = Transformer(model_config_from_hf(read_hf_config(path)))
    model.init_weights(1)  # different values everywhere, so every weight must be loaded
    load_hf_weights(model, path)
    return model


def tokens(n=2, t=24):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_through_import(family, tmp_path):
    reference = hf_directory(family, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:  # HF's per-expert layout
        assert any(".experts.3." in name for name in f.keys())
    ours = ours_from(tmp_path).eval()
    assert count_parameters(ours.cfg) == sum(p.numel() for p in reference.parameters())
    x = tokens()
    with torch.no_grad():
        expected = reference(x).logits
        for compute in ("loop", "grouped"):
            for layer in moe_layers(ours).values():
                layer.experts.compute = compute
            torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_loss_and_training_loss_equal_transformers(family, tmp_path):
    reference = hf_directory(family, tmp_path)
    ours = ours_from(tmp_path).train()
    x = tokens()
    labels = torch.cat([x[:, 1:], torch.full_like(x[:, :1], IGNORE_INDEX)], 1)
    batch = Batch(x, labels)
    loss_sum = Pretrain().loss_sum(ours, batch)
    with torch.no_grad():
        out = reference(x, labels=x, output_router_logits=True)
    stats = [m.stats for m in moe_layers(ours).values()]
    expected_aux = load_balancing_loss_func(out.router_logits, 4, 2)
    torch.testing.assert_close(load_balancing_loss(stats), expected_aux, atol=1e-6, rtol=1e-6)
    # The whole loss of one micro-batch: cross-entropy + coef x aux, as transformers adds it.
    torch.testing.assert_close(loss_sum / batch.count_targets(), out.loss, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_weight_names_round_trip_with_stacking(family, tmp_path):
    hf_directory(family, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        files = {name: f.get_tensor(name) for name in f.keys()}
    cfg = model_config_from_hf(read_hf_config(tmp_path))
    ours = from_hf_state_dict(files, cfg.tie_embeddings)
    assert ours["layers.1.mlp.experts.gate"].shape == (4, 32, 64)
    assert set(ours) == set(Transformer(cfg).state_dict())
    back = to_hf_state_dict(ours, cfg.tie_embeddings, family)
    assert set(back) == set(files)
    for name, tensor in files.items():
        assert torch.equal(back[name], tensor), name
    assert f", {family})" in job_yaml(tmp_path)  # import-hf checks the directory and writes a job


@pytest.mark.parametrize("family, moe", [
    ("mixtral", dict(n_experts=4, top_k=2, intermediate_size=32)),
    ("qwen3_moe", dict(n_experts=4, top_k=2, intermediate_size=32, first_k_dense=1,
                       norm_topk_prob=False)),
])
def test_export_hf_of_a_moe_run_loads_in_transformers_with_same_logits(family, moe, tmp_path):
    cfg = tiny_job(tmp_path, model={"qk_norm": family == "qwen3_moe", "moe": moe},
                   train={"max_steps": 3, "micro_batch_size": 4, "sample_tokens": 0,
                          "eval_interval": 1000, "num_threads": 1},
                   data={"seq_len": 16, "max_bytes": 150_000}, checkpoint={"interval": None})
    train(cfg)
    out = tmp_path / "export"
    assert main(["export-hf", str(cfg.run_dir), str(out), "--dtype", "fp32"]) == 0
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    assert reloaded.config.model_type == family
    ours = Transformer(cfg.model).eval()
    load_model(ours, cfg.run_dir / "model.safetensors")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, ours(x), atol=1e-5, rtol=0)
    # The config round trip (Mixtral has no dense layers: its intermediate_size is the experts';
    # HF states head_dim where we derived it).
    update = {"head_dim": cfg.model.head_size} | ({"intermediate_size": 32} if family == "mixtral" else {})
    assert model_config_from_hf(hf_config_from_model(cfg.model)) == cfg.model.model_copy(update=update)


def test_export_refuses_a_mixture_transformers_cannot_run():
    cfg = ModelConfig(dim=64, n_heads=4, moe=dict(n_experts=4, gating="sigmoid", n_shared_experts=1))
    with pytest.raises(KilnError, match="gating=sigmoid.*n_shared_experts=1"):
        hf_config_from_model(cfg)


@pytest.mark.parametrize("preset, family, total, active", [
    ("mixtral-8x7b", "mixtral", 46.7e9, 12.9e9),
    ("qwen3-30b-a3b", "qwen3_moe", 30.5e9, 3.3e9),
])
def test_moe_preset_sizes_match_transformers(preset, family, total, active):
    cfg = ModelConfig(preset=preset)
    hf = {k: v for k, v in hf_config_from_model(cfg, "float32").items()
          if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(family, **hf))
        ours = Transformer(cfg)
    expected = sum(p.numel() for p in reference.parameters())
    assert count_parameters(cfg) == expected == sum(p.numel() for p in ours.parameters())
    assert count_parameters(cfg) == pytest.approx(total, rel=0.01)
    assert count_parameters(cfg, active=True) == pytest.approx(active, rel=0.02)
