"""Tuning methods: LoRA, DoRA and QLoRA layers, training an adapter over a Hugging Face base,
PEFT export (checked by loading it with `peft`), merging, base fingerprints and exact resume."""

import json
import math
import shutil

import pytest
import torch
import torch.distributed.checkpoint
import transformers
from safetensors.torch import load_file, save_file

from conftest import tiny_job
from kiln.checkpoint.hf_import import resolve_init_from
from kiln.checkpoint.storage import Storage
from kiln.cli import main
from kiln.errors import KilnError
from kiln.peft import merge_tuning
from kiln.peft.adapter import short
from kiln.peft.fingerprint import weights_fingerprint
from kiln.peft.lora import adapter_layers, is_adapter_name
from kiln.train.build import build_model
from kiln.train.loss import cross_entropy_sum
from kiln.train.optim import build_optimizer
from kiln.train.schedule import LRSchedule
from kiln.train.trainer import train

CPU = torch.device("cpu")
# conftest's tiny_job shape, as a Hugging Face Llama.
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=160, max_position_embeddings=128)
ADAPTER = dict(rank=4, alpha=8.0)


def hf_base(path, seed: int = 0, tie: bool = False):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=tie))
    with torch.no_grad():  # HF ones norms; make every weight count
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return hf_base(tmp_path_factory.mktemp("base") / "hf")


def job(tmp_path, base, method="lora", steps=6, **sections):
    train_cfg = {"max_steps": steps, "micro_batch_size": 4, "sample_tokens": 0,
                 "eval_interval": 1000, "log_interval": 3, **sections.pop("train", {})}
    return resolve_init_from(tiny_job(
        tmp_path, model={"init_from": str(base)}, peft={"method": method, **ADAPTER, **sections.pop("peft", {})},
        train=train_cfg, checkpoint={"interval": 3, "keep_last": None, **sections.pop("checkpoint", {})},
        schedule={"kind": "constant", "warmup_steps": 0}, data={"max_bytes": 150_000, "seq_len": 16},
        **sections))


def tokens(n=2, t=24):
    return torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(3))


def randomize_adapters(model, scale=0.1):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_name(name):
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def trained(cfg):
    """The run's model: the base rebuilt as training builds it, plus the saved adapter."""
    model = build_model(cfg, None, CPU).eval()
    result = model.load_state_dict(load_file(cfg.run_dir / "model.safetensors"), strict=False)
    assert not [n for n in result.missing_keys if is_adapter_name(n)] and not result.unexpected_keys
    return model


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_adapter_at_init_leaves_outputs_unchanged(tmp_path, base, method):
    plain = build_model(job(tmp_path, base, "full"), None, CPU).eval()
    adapted = build_model(job(tmp_path, base, method, peft={"rslora": True}), None, CPU).eval()
    with torch.no_grad():
        assert torch.equal(adapted(tokens()), plain(tokens()))
    # ...and the same holds for every layer whatever the adapter: nothing of the base changed.
    assert all(torch.equal(p, plain.state_dict()[n]) for n, p in adapted.state_dict().items()
               if not is_adapter_name(n))


def test_only_adapters_get_gradients_and_optimizer_state(tmp_path, base):
    cfg = job(tmp_path, base, "dora")
    model = build_model(cfg, None, CPU)
    optimizer = build_optimizer(model, cfg.optim)
    x = tokens()
    cross_entropy_sum(model(x[:, :-1]), x[:, 1:]).backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    with_state = {names[id(p)] for p in optimizer.state}
    adapters = {n for n, _ in model.named_parameters() if is_adapter_name(n)}
    # 2 layers x 7 targets x (A, B, magnitude)
    assert len(adapters) == 42 and with_grad == adapters and with_state == adapters
    assert all(not p.requires_grad for n, p in model.named_parameters() if n not in adapters)


def test_lora_on_a_mixture_of_experts_adapts_attention_and_freezes_the_experts(tmp_path):
    # A random MoE model (no Hugging Face base): adapters on attention, router and experts frozen.
    moe = {"n_experts": 4, "top_k": 2, "intermediate_size": 32, "n_shared_experts": 1}
    cfg = tiny_job(tmp_path, model={"moe": moe}, peft={"method": "lora", **ADAPTER,
                                                       "target_modules": ["q", "k", "v", "o"]},
                   train={"max_steps": 4, "log_interval": 1, "sample_tokens": 0, "eval_interval": 1000},
                   checkpoint={"interval": None})
    model = build_model(cfg, None, CPU)
    randomize_adapters(model)
    x = tokens()
    cross_entropy_sum(model(x[:, :-1]), x[:, 1:]).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert len(with_grad) == 2 * 4 * 2 and all(is_adapter_name(n) for n in with_grad)
    assert all(g.abs().sum() > 0 for n, g in ((n, p.grad) for n, p in model.named_parameters()
                                               if p.grad is not None))
    result = train(cfg)
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    # The adapter alone is stored: the router, routed and shared experts stay the base's.
    stored = load_file(cfg.run_dir / "model.safetensors")
    assert stored.keys() == {n for n in model.state_dict() if is_adapter_name(n)}
    # The default targets include the MLP's gate/up/down: refused, naming what to do instead.
    with pytest.raises(ValueError, match=r"mixtures of experts.*\[q, k, v, o\]"):
        tiny_job(tmp_path, model={"moe": moe}, peft={"method": "lora"})


def test_loraplus_trains_b_matrices_at_their_own_learning_rate(tmp_path, base):
    cfg = job(tmp_path, base, "lora", peft={"loraplus_lr_ratio": 16.0})
    model = build_model(cfg, None, CPU)
    optimizer = build_optimizer(model, cfg.optim, cfg.peft.loraplus_lr_ratio)
    schedule = LRSchedule(optimizer, cfg.optim.lr, cfg.schedule, 6)  # it sets every group's LR
    names = {id(p): n for n, p in model.named_parameters()}
    lrs = {names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert len(lrs) == 28 and all(
        lr == schedule.lr * (16 if n.endswith("lora_B.weight") else 1) for n, lr in lrs.items())
    # AdamW's first step moves each entry with a gradient by its lr: B, from zero, by 16 lr.
    b = model.layers["0"].attn.q.lora_B.weight
    x = tokens()
    cross_entropy_sum(model(x[:, :-1]), x[:, 1:]).backward()
    optimizer.step()
    assert b.detach().abs().max().item() == pytest.approx(16 * cfg.optim.lr, rel=1e-3)
    with pytest.raises(ValueError, match="loraplus_lr_ratio is for adapters"):
        job(tmp_path, base, "full", peft={"loraplus_lr_ratio": 16.0})
    with pytest.raises(ValueError, match="dora adapts linear layers"):
        job(tmp_path, base, "dora", peft={"target_modules": ["q", "embed"]})


def test_adapter_swapped_in_for_q_changes_logits_as_lora_says(tmp_path, base):
    cfg = job(tmp_path, base, "lora", peft={"target_modules": ["q"]})
    model = build_model(cfg, None, CPU).eval()
    plain = build_model(job(tmp_path, base, "full"), None, CPU).eval()
    assert [n for n, _ in adapter_layers(model)] == ["layers.0.attn.q", "layers.1.attn.q"]
    q = model.layers["0"].attn.q
    with torch.no_grad():
        q.lora_B.weight.normal_(0, 0.1)
        x = torch.randn(3, 64)
        want = x @ plain.layers["0"].attn.q.weight.T + 2.0 * x @ q.lora_A.weight.T @ q.lora_B.weight.T
        torch.testing.assert_close(q(x), want)
        assert (model(tokens()) - plain(tokens())).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["lora", "dora", "qlora"])
def test_merged_model_equals_base_plus_adapter(tmp_path, base, method):
    model = build_model(job(tmp_path, base, method, peft={"rslora": method == "dora"}), None, CPU).eval()
    randomize_adapters(model)
    with torch.no_grad():
        before = model(tokens())
        merge_tuning(model)
        assert not adapter_layers(model)
        torch.testing.assert_close(model(tokens()), before, atol=1e-5, rtol=0)


def test_qlora_forward_is_close_to_the_unquantised_one(tmp_path, base):
    lora = build_model(job(tmp_path, base, "lora"), None, CPU).eval()
    qlora = build_model(job(tmp_path, base, "qlora"), None, CPU).eval()
    for model in (lora, qlora):
        randomize_adapters(model)
    q = qlora.layers["0"].attn.q
    assert type(q.weight).__name__ == "NF4Tensor"
    with torch.no_grad():
        want, got = lora(tokens()), qlora(tokens())
    # NF4 keeps each weight to about 9% (relative RMS, normal weights); over 14 quantised
    # layers the logits stay within about twice that, and their ranking mostly agrees.
    dense = lora.layers["0"].attn.q.weight
    assert (q.dense_weight() - dense).norm() / dense.norm() < 0.1
    error = (got - want).norm() / want.norm()
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert 1e-3 < error < 0.2 and cosine > 0.98, (error, cosine)
    # The NF4 base holds about 4 bits per weight: an eighth of fp32 and some scales.
    nf4_bytes = sum(t.numel() * t.element_size() for t in (
        q.weight.quantized_data, q.weight.quantized_scalers, q.weight.quantization_factor))
    assert nf4_bytes < 0.2 * q.weight.numel() * 4


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, base):
    """Short LoRA (12 steps) and DoRA (6 steps) runs from the Hugging Face base, with
    checkpoints every 3 steps."""
    runs = {}
    for method, steps in (("lora", 12), ("dora", 6)):
        cfg = job(tmp_path_factory.mktemp(method), base, method, steps=steps)
        runs[method] = (cfg, train(cfg))
    return runs


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_peft_loads_the_exported_adapter_with_kiln_logits(tmp_path, lora_runs, method):
    import peft

    cfg, _ = lora_runs[method]
    out = tmp_path / "adapter"
    assert main(["export-hf", str(cfg.run_dir), str(out), "--dtype", "fp32"]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["use_dora"] == (method == "dora") and config["r"] == 4
    names = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in names
    # The base from the directory the adapter names, then the adapter on it, by peft itself.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        config["base_model_name_or_path"], attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        base_logits = hf(tokens()).logits
    theirs = peft.PeftModel.from_pretrained(hf, out).eval()
    ours = trained(cfg)
    with torch.no_grad():
        want = ours(tokens())
        torch.testing.assert_close(theirs(tokens()).logits, want, atol=1e-5, rtol=0)
        assert (want - base_logits).abs().max() > 1e-3  # the adapter did change the model

    merged = tmp_path / "merged"
    assert main(["export-hf", str(cfg.run_dir / "checkpoints"), str(merged), "--dtype", "fp32", "--merge"]) == 0
    full = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager",
                                                            dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(full(tokens()).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method,targets", [("lora", ["q", "v", "embed", "lm_head"]),
                                            ("dora", ["q", "v", "lm_head"])])
def test_adapter_on_a_tied_embedding_and_lm_head_round_trips_through_peft(tmp_path, method, targets):
    """The embedding and lm_head as targets of a model whose output layer is its embedding: each
    adapter changes its own side (the lookup, the logits) over the shared frozen weight, as in
    peft, and merging unties the two."""
    import peft

    base = hf_base(tmp_path / "tied", tie=True)
    cfg = job(tmp_path / "run", base, method, peft={"target_modules": targets})
    ref = train(cfg)
    # Stopped after 3 steps and resumed to 6: the losses of the run that never stopped.
    train(job(tmp_path / "cut", base, method, steps=3, peft={"target_modules": targets}))
    resumed = train(job(tmp_path / "cut", base, method, peft={"target_modules": targets}))
    assert resumed.start_step == 3 and resumed.losses == ref.losses[3:]
    ours = trained(cfg)
    assert ours.lm_head.weight is ours.embed.weight and not ours.embed.weight.requires_grad
    assert ours.lm_head.lora_B.weight.abs().max() > 0  # the head's adapter trained
    if "embed" in targets:  # and the embedding's (its A starts at zero)
        assert ours.embed.lora_embedding_A.abs().max() > 0
    # The tied base weight is stored nowhere, under neither of its names.
    saved = torch.distributed.checkpoint.FileSystemReader(
        cfg.run_dir / "checkpoints" / "step-000006").read_metadata().state_dict_metadata
    assert all(is_adapter_name(n) for n in load_file(cfg.run_dir / "model.safetensors"))
    assert all(is_adapter_name(n) for n in saved if n.startswith("model."))
    out = tmp_path / "adapter"
    assert main(["export-hf", str(cfg.run_dir), str(out), "--dtype", "fp32"]) == 0
    assert "lm_head" in json.loads((out / "adapter_config.json").read_text())["target_modules"]
    names = set(load_file(out / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.lora_B.weight" in names
    assert ("base_model.model.model.embed_tokens.lora_embedding_A" in names) == ("embed" in targets)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager",
                                                          dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, out).eval()
    with torch.no_grad():
        want = ours(tokens())
        torch.testing.assert_close(theirs(tokens()).logits, want, atol=1e-5, rtol=0)

    merged = tmp_path / "merged"
    assert main(["export-hf", str(cfg.run_dir), str(merged), "--dtype", "fp32", "--merge"]) == 0
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is False
    full = transformers.AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager",
                                                            dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(full(tokens()).logits, want, atol=1e-5, rtol=0)
        if "embed" not in targets:
            torch.testing.assert_close(full.model.embed_tokens.weight, hf.get_input_embeddings().weight)


def test_lora_run_trains_stores_no_base_and_resumes_exactly(tmp_path, lora_runs, base):
    cfg, ref = lora_runs["lora"]
    # The loss falls: below the frozen base's on the very same batches (a run that barely
    # moves), by more than batch-to-batch noise allows comparing in one run.
    frozen = train(job(tmp_path / "frozen", base, "lora", steps=12, optim={"lr": 1e-9},
                       checkpoint={"enabled": False}))
    gain = [b - a for a, b in zip(ref.losses, frozen.losses)]
    assert gain[0] == 0 and sum(gain[-4:]) / 4 > 0.03, gain
    # Neither the checkpoints nor the final weights hold the base: only adapter tensors.
    committed = Storage(str(cfg.run_dir / "checkpoints")).committed()
    assert [c.step for c in committed] == [3, 6, 9, 12]
    assert "adapter.json" in committed[-1].marker["files"]
    saved = _dcp_keys(committed[-1].url)
    assert saved and all(is_adapter_name(k) for k in saved)
    assert all(is_adapter_name(k) for k in load_file(cfg.run_dir / "model.safetensors"))
    record = json.loads((cfg.run_dir / "adapter.json").read_text())
    assert record["base_fingerprint"] == weights_fingerprint(base) and record["task"] == "pretrain"

    # Stopped after 6 steps, resumed to 12: the same losses as the run that never stopped.
    cut = job(tmp_path, base, "lora", steps=6)
    train(cut)
    resumed = train(job(tmp_path, base, "lora", steps=12))
    assert resumed.start_step == 6 and resumed.losses == ref.losses[6:]
    got, want = load_file(cut.run_dir / "model.safetensors"), load_file(cfg.run_dir / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _dcp_keys(url):
    from kiln.checkpoint.checkpointer import reader_for

    meta = reader_for(url, {}).read_metadata().state_dict_metadata
    return [k.removeprefix("model.") for k in meta if k.startswith("model.")]


def test_adapter_on_another_base_is_refused(tmp_path, lora_runs):
    cfg, _ = lora_runs["lora"]
    other = hf_base(tmp_path / "other", seed=1)
    run = tmp_path / "copy"
    shutil.copytree(cfg.run_dir, run / "runs" / "t")
    moved = job(run, other, "lora", steps=8)
    want = rf"fingerprint {short(weights_fingerprint(cfg.model.init_from))}.*fingerprint {short(weights_fingerprint(other))}"
    with pytest.raises(KilnError, match=want):
        train(moved)
    # The base named by the run changed under it: merging refuses too, and writes nothing.
    changed = tmp_path / "changed"
    shutil.copytree(cfg.model.init_from, changed)
    moved_cfg = json.loads(json.dumps(cfg.model_dump(mode="json")))
    moved_cfg["model"]["init_from"] = str(changed)
    (run / "runs" / "t" / "config.yaml").write_text(json.dumps(moved_cfg))
    shutil.rmtree(run / "runs" / "t" / "checkpoints")  # export from the run's final weights
    weights = load_file(changed / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, str(changed / "model.safetensors"), metadata={"format": "pt"})
    assert main(["export-hf", str(run / "runs" / "t"), str(tmp_path / "merged"), "--merge"]) == 2
    assert not (tmp_path / "merged").exists()


def test_adapters_lists_runs_and_exports_with_their_base(tmp_path, lora_runs, capsys):
    cfg, _ = lora_runs["dora"]
    out = tmp_path / "exported"
    assert main(["export-hf", str(cfg.run_dir), str(out)]) == 0
    root = tmp_path / "all"
    shutil.copytree(cfg.run_dir, root / "runs" / "dora-run")
    shutil.copytree(out, root / "exports" / "dora")
    capsys.readouterr()
    assert main(["adapters", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["adapter", "method", "rank", "task", "size"]
    fingerprint = short(weights_fingerprint(cfg.model.init_from))
    rows = [line for line in lines[1:] if fingerprint in line]
    assert len(rows) == 2 and all(" dora " in r and " pretrain " in r for r in rows)
    assert any("runs/dora-run" in r for r in rows) and any("exports/dora" in r for r in rows)


@pytest.mark.parametrize("method", ["dora", "qlora"])
def test_adapters_compose_with_activation_checkpointing_and_bf16(tmp_path, base, method):
    x = tokens()
    grads = []
    for checkpointing in (False, True):
        model = build_model(job(tmp_path, base, method, train={"activation_checkpointing": checkpointing}), None, CPU)
        randomize_adapters(model)
        cross_entropy_sum(model(x[:, :-1]), x[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(is_adapter_name(n) for n in grads[0])
    for name, grad in grads[0].items():  # recomputed activations, the same gradients
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy_sum(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    bf16 = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert bf16.keys() == grads[0].keys() and all(g.dtype == torch.float32 and g.isfinite().all() for g in bf16.values())


def test_qlora_under_compile_trains_as_eager(tmp_path, base):
    # train.compile compiles each block: LoRA's adapter half and QLoRA's NF4 base (torchao's
    # tensor subclass, dequantised in the forward) go through dynamo and Inductor, which only
    # sum in another order. One case, QLoRA (a superset of LoRA's layer): compiling takes
    # about a minute on 2 cores.
    from torch._dynamo.utils import counters

    losses = []
    for compiled in (False, True):
        counters.clear()
        cfg = job(tmp_path / str(compiled), base, "qlora", steps=3,
                  train={"compile": compiled, "log_interval": 1}, checkpoint={"interval": None})
        losses.append(train(cfg).losses)
        assert (counters["stats"]["unique_graphs"] > 0) == compiled
    assert len(losses[1]) == 3 and losses[1] == pytest.approx(losses[0], abs=1e-5)


def test_fingerprint_is_cached_beside_the_weights_and_follows_them(tmp_path, base):
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    (copy / "kiln-fingerprint.json").unlink(missing_ok=True)
    first = weights_fingerprint(copy)
    cache = json.loads((copy / "kiln-fingerprint.json").read_text())
    assert cache["fingerprint"] == first == weights_fingerprint(base)
    # Read from the cache while the files are unchanged...
    (copy / "kiln-fingerprint.json").write_text(json.dumps({**cache, "fingerprint": "sha256:cached"}))
    assert weights_fingerprint(copy) == "sha256:cached"
    # ...and hashed again once they change (the same tensors in another file layout agree).
    weights = load_file(copy / "model.safetensors")
    save_file(dict(reversed(list(weights.items()))), str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert weights_fingerprint(copy) == first
    weights["model.norm.weight"][0] += 1e-3
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert weights_fingerprint(copy) not in (first, "sha256:cached")
