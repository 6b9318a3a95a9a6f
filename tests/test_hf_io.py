"""Hugging Face interoperability: export a run for `transformers`, import a `save_pretrained`
directory, train it, export it again, reload it."""

import json

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file, load_model

from conftest import tiny_job
from kiln.checkpoint.hf_import import resolve_init_from, load_hf_weights
from kiln.cli import main
from kiln.config import JobConfig, ModelConfig
from kiln.errors import KilnError
from kiln.models.transformer import Transformer
from kiln.train.trainer import train

# The shape of conftest's tiny_job, so its model fields agree with these directories.
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=160, max_position_embeddings=128)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(rope_theta=500000.0, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
}
QUICK = dict(train={"max_steps": 4, "micro_batch_size": 4, "sample_tokens": 0, "eval_interval": 1000},
             data={"seq_len": 16, "max_bytes": 150_000}, checkpoint={"interval": None})


def tokens(n=2, t=24):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(3))


def ours_from_run(run_dir, model_cfg: ModelConfig) -> Transformer:
    model = Transformer(model_cfg).eval()
    load_model(model, run_dir / "model.safetensors")  # restores a tied lm_head too
    return model


def reload(out) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()


def assert_same_logits(ours: Transformer, hf: transformers.PreTrainedModel) -> None:
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)


def hf_directory(family: str, path, shard: str | None = None):
    config_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**TINY, **extra)).float()
    with torch.no_grad():  # HF zero-inits biases and ones norms; make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model.eval()


def test_export_hf_loads_in_transformers_with_same_logits(tmp_path):
    cfg = tiny_job(tmp_path, **QUICK)
    train(cfg)
    out = tmp_path / "export"
    assert main(["export-hf", str(cfg.run_dir), str(out), "--dtype", "fp32"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json",
            "model-00001-of-00001.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert_same_logits(ours_from_run(cfg.run_dir, cfg.model), reload(out))

    # The tokenizer loads through transformers and gives our ids; EOS is known to generation.
    ours = __import__("tokenizers").Tokenizer.from_file(str(cfg.run_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "def add(a, b):\n    return a + b\n"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.token_to_id("<|endoftext|>")

    # bf16: half the bytes, and still a model transformers loads.
    bf16 = tmp_path / "bf16"
    assert main(["export-hf", str(cfg.run_dir / "checkpoints"), str(bf16)]) == 0
    shard = load_file(bf16 / "model-00001-of-00001.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in shard.values())
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
    assert main(["export-hf", str(cfg.run_dir), str(out)]) == 2  # never over an existing export


@pytest.mark.parametrize("family", FAMILIES)
def test_import_hf_directory_trains_exports_and_reloads(family, tmp_path):
    source = tmp_path / "hf"
    reference = hf_directory(family, source, shard="60KB")
    assert (source / "model.safetensors.index.json").is_file()  # a sharded directory

    # `kiln import-hf` writes a job that starts from the directory.
    job_file = tmp_path / "job.yaml"
    assert main(["import-hf", str(source), "--out", str(job_file)]) == 0
    assert yaml.safe_load(job_file.read_text())["model"]["init_from"] == str(source.resolve())

    # The weights load into our model unchanged: same logits as the transformers model.
    cfg = resolve_init_from(tiny_job(tmp_path, model={"init_from": str(source)}, **QUICK))
    assert cfg.model.qkv_bias == (family == "qwen2") and cfg.model.rope_theta == FAMILIES[family][1]["rope_theta"]
    start = Transformer(cfg.model).eval()
    load_hf_weights(start, source)
    assert_same_logits(start, reference)

    result = train(cfg)
    assert result.steps == 4 and result.start_step == 0
    out = tmp_path / "export"
    assert main(["export-hf", str(cfg.run_dir), str(out), "--dtype", "fp32"]) == 0
    trained = ours_from_run(cfg.run_dir, cfg.model)
    reloaded = reload(out)
    assert type(reloaded) is type(reference)
    assert_same_logits(trained, reloaded)
    with torch.no_grad():
        assert not torch.allclose(reloaded(tokens()).logits, reference(tokens()).logits)


def test_import_errors_name_the_problem(tmp_path):
    # Validation reads no files; resolving init_from (when a job starts) does.
    unresolved = JobConfig.model_validate({"model": {"init_from": str(tmp_path / "missing")}})
    with pytest.raises(KilnError, match="config.json"):
        resolve_init_from(unresolved)
    source = tmp_path / "hf"
    hf_directory("llama", source)
    wrong = resolve_init_from(tiny_job(tmp_path, model={"init_from": str(source), "intermediate_size": 128}))
    with pytest.raises(KilnError, match=r"wrong shape.*mlp"):
        load_hf_weights(Transformer(wrong.model), source)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_exported_config_rebuilds_each_family_in_transformers(family):
    from test_hf_parity import hf_model

    from kiln.models.hf import hf_config_from_model, model_config_from_hf

    reference = hf_model(family)  # Llama 3 RoPE scaling, Qwen2 q/k/v bias, Qwen3 q/k norm, ...
    cfg = model_config_from_hf(reference.config.to_dict())
    hf = hf_config_from_model(cfg, "float32")
    back = model_config_from_hf(hf)
    assert back.head_size == cfg.head_size  # written out explicitly, for serving engines
    back = back.model_copy(update={"head_dim": cfg.head_dim})
    assert back == cfg, {k: (v, getattr(cfg, k)) for k, v in back if v != getattr(cfg, k)}
    config = transformers.AutoConfig.for_model(**hf)
    rebuilt = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    rebuilt.load_state_dict(reference.state_dict())  # the same architecture, the same names
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x).logits, reference(x).logits, atol=1e-5, rtol=0)
