"""Supervised fine-tuning: chat templates and masks, kiln prepare --sft, packing, the sft task."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from kiln.cli import main
from kiln.config import ModelConfig, load_config
from kiln.data.batch import IGNORE_INDEX
from kiln.data.chat import DEFAULT_TEMPLATE, LAST_TURN, ChatFormat
from kiln.data.docstrings import docstring_pairs, function_pairs
from kiln.data.packing import SFTExamples, _best_fit_decreasing
from kiln.data.prepare import PrepareOptions
from kiln.data.sft import prepare_sft
from kiln.data.shards import ShardSet
from kiln.data.show import CLOSE, OPEN, show_rows
from kiln.data.tokenizer import describe, save_tokenizer, train_bpe
from kiln.models.transformer import Transformer
from kiln.tasks.sft import Sft
from kiln.train.trainer import forward_backward

from conftest import tiny_job

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# The same template with transformers' {% generation %} marks around the assistant's part.
CHATML_MARKED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}")
WORDS = "what is two plus three sure five hello there how are you fine thanks the answer".split()

CHAT = [{"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "what is two plus three?"},
        {"role": "assistant", "content": "Sure: five."},
        {"role": "user", "content": "and how are you?"},
        {"role": "assistant", "content": "Fine, thanks!"}]


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(2, 12))) for _ in range(n)]


@pytest.fixture(scope="module")
def chatml():
    tok = train_bpe(sentences(200, 0), 300)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return describe(tok, {"eos_token": "<|im_end|>", "chat_template": CHATML})


@pytest.fixture(scope="module")
def plain():
    """A tokenizer without a chat template (kiln's default template applies)."""
    return describe(train_bpe(sentences(200, 1), 300))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def opts(**kw):
    return PrepareOptions(progress=False, workers=1, **kw)


def pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": p, "response": r} for p, r in zip(
        sentences(n, seed), [" ".join(rng.choice(WORDS, rng.integers(1, 30))) for _ in range(n)])]


def test_multi_turn_chat_masks_exactly_the_assistant_turns_like_transformers(chatml, tmp_path):
    encoded = ChatFormat(chatml).encode(CHAT)
    hf = PreTrainedTokenizerFast(tokenizer_object=chatml.tokenizer, eos_token="<|im_end|>")
    reference = hf.apply_chat_template(CHAT, chat_template=CHATML_MARKED, return_dict=True,
                                       return_assistant_tokens_mask=True)
    assert encoded.ids.tolist() == hf.apply_chat_template(CHAT, chat_template=CHATML)["input_ids"]
    assert encoded.ids.tolist() == reference["input_ids"]
    assert (encoded.mask > 0).astype(int).tolist() == reference["assistant_masks"]

    # Through prepare and collate: the labels are exactly the tokens of the two replies with
    # their end-of-turn tokens, at the positions just before them.
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    prepare_sft([path], chatml, tmp_path / "out", opts())
    decode = lambda ids: chatml.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    ids = encoded.ids
    for loss_on, replies in (("assistant", ["Sure: five.<|im_end|>\n", "Fine, thanks!<|im_end|>\n"]),
                             ("last", ["Fine, thanks!<|im_end|>\n"]),
                             ("all", [decode(ids[1:].tolist())])):
        examples = SFTExamples(ShardSet(tmp_path / "out"), 128, loss_on)
        batch, _ = examples.collate([examples.sample(0)])
        labels = batch.labels[0, :len(ids) - 1].numpy()
        kept = np.flatnonzero(labels != IGNORE_INDEX)
        assert labels[kept].tolist() == ids[kept + 1].tolist()
        runs = np.split(kept, np.flatnonzero(np.diff(kept) > 1) + 1)
        assert [decode(ids[r + 1].tolist()) for r in runs] == replies
        assert batch.tokens[0, :len(ids) - 1].tolist() == ids[:-1].tolist()


def test_prepare_sft_reads_messages_and_prompt_response_from_jsonl_and_parquet(plain, tmp_path):
    records = pairs(30) + [{"messages": CHAT}]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    pq.write_table(pa.table({"messages": [CHAT, CHAT[1:3]]}), tmp_path / "b.parquet")
    result = prepare_sft([jsonl, str(tmp_path / "b.parquet")], plain, tmp_path / "out",
                         opts(val_fraction=0.2))
    manifest = result.manifest
    assert manifest["sft"]["examples"] == 33 and manifest["sft"]["template"] == "kiln default"
    shards = {split: ShardSet(tmp_path / "out", split) for split in ("train", "val")}
    assert sum(len(s.documents()[0]) for s in shards.values()) == 33
    chat = ChatFormat(plain)
    expected = [chat.encode([{"role": "user", "content": r["prompt"]},
                             {"role": "assistant", "content": r["response"]}]) for r in pairs(30)]
    expected += [chat.encode(CHAT), chat.encode(CHAT), chat.encode(CHAT[1:3])]  # jsonl, parquet
    train = shards["train"]
    starts, lengths = train.documents()
    got = [(train.read(s, n).tolist(), train.read(s, n, mask=True).tolist())
           for s, n in zip(starts, lengths)]
    want = [(e.ids.tolist(), e.mask.tolist()) for i, e in enumerate(expected)
            if i in _train_indices(33, 0.2)]
    assert got == want
    # kiln's default template: the reply and its EOS are the last turn
    text = plain.tokenizer.decode(expected[0].ids[expected[0].mask == LAST_TURN].tolist(),
                                  skip_special_tokens=False)
    assert text == pairs(30)[0]["response"] + "<|endoftext|>"
    assert prepare_sft([jsonl, str(tmp_path / "b.parquet")], plain, tmp_path / "out",
                       opts(val_fraction=0.2)).reused


def _train_indices(n, val_fraction):
    from kiln.data.prepare import split_of

    return {i for i in range(n) if split_of(i, val_fraction) == "train"}


@pytest.mark.parametrize("record, message", [
    ({"prompt": "hi"}, "has 'prompt' but no 'response' field"),
    ({"text": "hi"}, "no 'messages' field and no 'prompt'/'response' fields (the record has: text)"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "message 1 has role 'robot'"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "message 1 content is a int, not a string"),
])
def test_prepare_sft_bad_records_are_clear_errors_without_traceback(tmp_path, plain, capsys,
                                                                     record, message):
    save_tokenizer(plain, tmp_path / "tok")
    path = write_jsonl(tmp_path / "in.jsonl", pairs(2) + [record])
    rc = main(["prepare", "--sft", path, "--tokenizer", str(tmp_path / "tok"),
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"in.jsonl, line 3: {message}" in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_prepare_sft_cli_with_a_chat_template_file(tmp_path, chatml, capsys):
    save_tokenizer(chatml, tmp_path / "tok")
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    path = write_jsonl(tmp_path / "in.jsonl", [{"messages": CHAT}] + pairs(5))
    assert main(["prepare", "--sft", path, "--tokenizer", str(tmp_path / "tok"), "--out",
                 str(tmp_path / "out"), "--chat-template", str(template)]) == 0
    assert "sft: given chat template" in capsys.readouterr().out
    shards = ShardSet(tmp_path / "out")
    n = ChatFormat(chatml).encode(CHAT).ids.size
    assert shards.read(0, n).tolist() == ChatFormat(chatml, CHATML).encode(CHAT).ids.tolist()


def test_overlong_examples_are_truncated_or_dropped_and_counted(plain, tmp_path):
    records = pairs(40, seed=3)
    prepare_sft([write_jsonl(tmp_path / "a.jsonl", records)], plain, tmp_path / "out", opts())
    shards = ShardSet(tmp_path / "out")
    lengths = shards.documents()[1]
    seq_len = int(np.median(lengths))
    over = int((lengths > seq_len + 1).sum())
    assert 0 < over < len(lengths)
    cut = SFTExamples(shards, seq_len, overlong="truncate")
    dropped = SFTExamples(shards, seq_len, overlong="drop")
    assert dropped.counts.dropped_overlong == over and dropped.counts.kept == len(lengths) - over
    assert cut.counts.truncated + cut.counts.dropped_no_targets == over
    assert cut.counts.kept == len(lengths) - cut.counts.dropped_no_targets
    for examples in (cut, dropped):
        rows = [examples.sample(i) for i in range(len(examples))]
        assert all(sum(len(ids) - 1 for ids, _ in row) <= seq_len for row in rows)
        assert sum(len(row) for row in rows) == examples.counts.kept
        batch, _ = examples.collate(rows)
        assert batch.count_targets() == examples.counts.targets


def test_packed_and_unpacked_batches_give_the_same_loss_and_gradients(plain, tmp_path):
    torch.manual_seed(0)
    prepare_sft([write_jsonl(tmp_path / "a.jsonl", pairs(24, seed=5) + [{"messages": CHAT}])],
                plain, tmp_path / "out", opts())
    shards = ShardSet(tmp_path / "out")
    packed = SFTExamples(shards, 160, packing=True)
    unpacked = SFTExamples(shards, 160, packing=False)
    assert len(packed) < len(unpacked) == packed.counts.kept  # several examples per packed row
    model = Transformer(ModelConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    intermediate_size=64, max_seq_len=160, init_std=0.2))
    model.init_weights(0)
    loss_sum = Sft().loss_sum

    def run(batches):
        model.zero_grad()
        loss = forward_backward(model, loss_sum, batches)
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    rows = [packed.sample(i) for i in range(len(packed))]
    packed_batch, padding = packed.collate(rows)
    assert packed_batch.positions is not None and (packed_batch.positions == 0).sum() > len(rows)
    assert padding == packed_batch.tokens.numel() - sum(len(ids) - 1 for r in rows for ids, _ in r)
    one = [unpacked.sample(i) for i in range(len(unpacked))]
    half = len(one) // 2  # two micro-batches: the global count of targets normalises both
    loss_a, grads_a = run([packed_batch])
    loss_b, grads_b = run([unpacked.collate(one[:half])[0], unpacked.collate(one[half:])[0]])
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-4, msg=name)
    # Without the document ids the packed examples would see each other: a different loss.
    packed_batch.document_ids = None
    packed_batch.positions = None
    assert abs(run([packed_batch])[0] - loss_a) > 1e-4


def test_loader_reports_padding_and_targets_and_resumes_at_the_same_row(plain, tmp_path):
    prepare_sft([write_jsonl(tmp_path / "a.jsonl", pairs(60, seed=7))], plain, tmp_path / "out",
                opts(val_fraction=0.2))
    job = tiny_job(tmp_path, task="sft", data=dict(source="shards", seq_len=48, sources=[
        dict(name="pairs", path=str(tmp_path / "out"))], val=[dict(name="pairs", path=str(tmp_path / "out"))]),
        train=dict(micro_batch_size=3))
    data = Sft().build_data(job, tmp_path / "run", 0, 1)
    first = [next(data.train) for _ in range(2)]
    stats = data.train.window_stats(steps=2)
    positions = sum(b.tokens.numel() for b in first)
    real = sum(int((b.document_ids >= 0).sum()) for b in first)
    assert stats["padding_fraction"] == pytest.approx(1 - real / positions)
    assert stats["trained_tokens_per_step"] == sum(int(b.count_targets()) for b in first) / 2
    state = data.train.state_dict()
    then = [next(data.train) for _ in range(3)]
    again = Sft().build_data(job, tmp_path / "run", 0, 1)
    again.train.load_state_dict(state)
    for a, b in zip(then, [next(again.train) for _ in range(3)]):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.document_ids, b.document_ids)
    data.train.close()
    again.train.close()


def test_docstring_pairs_strip_the_docstring_and_split_by_module():
    text = ('import os\n\n\nclass A:\n    @staticmethod\n    def f(x, y=1):\n'
            '        """Add y to x.\n\n        Returns the sum.\n        """\n\n'
            '        return x + y\n\n    def g(self):\n        "only a docstring"\n\n'
            'def h(): "same line"; return 1\n')
    found = function_pairs("m.py", text)
    assert [(p.name, p.source, p.docstring) for p in found] == [
        ("f", "@staticmethod\ndef f(x, y=1):\n    return x + y\n", "Add y to x.\n\nReturns the sum.")]
    assert found[0].summary == "Add y to x." and found[0].messages()[1]["content"] == "Add y to x."
    train, held_out, _ = docstring_pairs(0.2, max_bytes=400_000)
    train_modules = {p.module for p in train}
    held_modules = {p.module for p in held_out}
    assert train_modules and held_modules and not train_modules & held_modules


def test_quickstart_sft_config_builds_its_docstring_data_on_a_small_slice(tmp_path, capsys):
    texts = [p.source + p.docstring for p in docstring_pairs(0.2, max_bytes=400_000)[0]]
    tok = describe(train_bpe(texts, 512))
    save_tokenizer(tok, tmp_path / "tok")
    cfg = load_config("configs/quickstart-sft.yaml", [
        f"out_dir={tmp_path}", "data.max_bytes=400000", "data.val_fraction=0.2",
        f"data.tokenizer={tmp_path / 'tok'}", "train.micro_batch_size=4"])
    assert cfg.task == "sft" and cfg.data.source == "stdlib"
    data = Sft().build_data(cfg, cfg.run_dir, 0, 1)
    out = capsys.readouterr().out
    assert "kiln: sft train 'docstrings'" in out and "kiln: sft val 'docstrings'" in out
    batch = next(data.train)
    data.train.close()
    assert batch.tokens.shape == (4, cfg.data.seq_len) and batch.count_targets() > 0
    # every trained-on stretch of a held-out example is its docstring, closed by the template
    examples = data.val_samples["docstrings"]
    prompt, reply = examples.prompt_and_reply(0)
    held_out = list(docstring_pairs(0.2, max_bytes=400_000)[1])
    decoded = tok.tokenizer.decode(reply.tolist(), skip_special_tokens=False)
    assert any(decoded.startswith(p.summary) for p in held_out), decoded
    shown = show_rows(cfg, 2)
    assert shown.count("=== row") == 2 and OPEN in shown and CLOSE in shown


def test_default_template_renders_a_generation_prompt_that_prefixes_the_reply(plain):
    chat = ChatFormat(plain)
    assert chat.source == DEFAULT_TEMPLATE
    prompt = chat.render(CHAT[1:2], add_generation_prompt=True)
    assert chat.render(CHAT[1:3]) == prompt + "Sure: five.<|endoftext|>"


def test_shipped_fine_tuning_configs_validate():
    for name, task in (("finetune-full", "sft"), ("continued-pretraining", "pretrain"),
                       ("quickstart-sft", "sft")):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.task == task and cfg.model.init_from == "runs/quickstart/hf"


def test_sft_job_pretrains_its_missing_base_then_fine_tunes_and_writes_replies(tmp_path, capsys):
    base = tiny_job(tmp_path, name="base", model=dict(max_seq_len=256),
                    train=dict(max_steps=6, eval_interval=6, sample_tokens=0))
    (tmp_path / "base.yaml").write_text(base.to_yaml())
    rc = main(["train", "configs/quickstart-sft.yaml", "--set", f"out_dir={tmp_path / 'runs'}",
               "--set", f"model.init_from={tmp_path / 'base-hf'}",
               "--set", f"sft.base_job={tmp_path / 'base.yaml'}", "--set", "sft.base_overrides=[]",
               "--set", "data.max_bytes=400000", "--set", "data.val_fraction=0.2",
               "--set", "data.seq_len=128", "--set", "sft.overlong=truncate",
               "--set", "sft.samples=2", "--set", "train.sample_tokens=6",
               "--set", "train.micro_batch_size=4", "--set", "train.max_steps=4",
               "--set", "train.eval_interval=4", "--set", "train.eval_batches=1",
               "--set", "train.log_interval=2", "--set", "precision.dtype=fp32",
               "--set", "metrics.peak_tflops=0.1", "--set", "metrics.progress_bar=off"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no base model at" in out and "exported" in out and (tmp_path / "base-hf/config.json").is_file()
    assert out.count("--- held-out prompt ---") == 2 and out.count("--- reference ---") == 2
    lines = [json.loads(line) for line in (tmp_path / "runs/quickstart-sft/metrics.jsonl").open()]
    logged = [r for r in lines if "loss" in r]
    assert len(logged) == 2 and all(0 <= r["padding_fraction"] < 1 and r["trained_tokens_per_step"] > 0
                                    for r in logged)
    # A second run finds the base exported and up to date: nothing is trained or exported again.
    from kiln.tasks.sft import ensure_base

    cfg = load_config("configs/quickstart-sft.yaml", [
        f"model.init_from={tmp_path / 'base-hf'}", f"sft.base_job={tmp_path / 'base.yaml'}",
        "sft.base_overrides=[]"])
    ensure_base(cfg)
    assert capsys.readouterr().out == ""


def test_packing_fills_rows_best_fit_decreasing():
    # Longest first, each into the row it fills most tightly: two full rows where filling in
    # order (40 | 30 24 | 20 10) needs three.
    order, starts = _best_fit_decreasing(np.array([40, 30, 24, 20, 10]), 64)
    rows = [sorted(order[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]
    assert rows == [[0, 2], [1, 3, 4]]
    # Every item once, no row over capacity, within BFD's bound of 11/9 of the fewest rows + 1.
    sizes = np.random.default_rng(0).integers(1, 65, 2000)
    order, starts = _best_fit_decreasing(sizes, 64)
    assert sorted(order.tolist()) == list(range(len(sizes)))
    used = [int(sizes[order[a:b]].sum()) for a, b in zip(starts[:-1], starts[1:])]
    assert max(used) <= 64 and len(used) <= 11 / 9 * np.ceil(sizes.sum() / 64) + 1
