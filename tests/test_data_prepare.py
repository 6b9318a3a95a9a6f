"""kiln prepare: raw text/JSONL/Parquet -> shards + manifest, crash safety, reruns, bad input."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kiln.data import prepare as prepare_module
from kiln.data.prepare import PrepareOptions, prepare, read_manifest, token_dtype
from kiln.data.shards import ShardSet
from kiln.data.tokenizer import describe, load_tokenizer, save_tokenizer, train_bpe
from kiln.errors import KilnError

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tok():
    return describe(train_bpe(texts(200, seed=9), 300))


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "score": i}) + "\n" for i, d in enumerate(docs)))
    return path


def stream(directory, split="train"):
    shards = ShardSet(directory, split)
    return shards.read(0, shards.total_tokens)


def expected(tok, docs):
    return np.concatenate([np.asarray(ids) for ids in tok.encode_documents(docs)])


def opts(**kw):
    return PrepareOptions(progress=False, workers=1, **kw)


def test_text_jsonl_and_parquet_round_trip_tokens_in_equal_tokens_out(tmp_path, tok):
    a, b, c = texts(40, 1), texts(30, 2), texts(1, 3)
    write_jsonl(tmp_path / "a.jsonl", a)
    pq.write_table(pa.table({"body": b, "n": list(range(30))}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text(c[0])
    inputs = [str(tmp_path / "a.jsonl"), str(tmp_path / "c.txt")]
    out = prepare(inputs, tok, tmp_path / "ac", opts(shard_tokens=500))
    np.testing.assert_array_equal(stream(tmp_path / "ac"), expected(tok, a + c))
    shards = ShardSet(tmp_path / "ac")
    assert len(shards.shards) > 2 and out.manifest["dtype"] == "uint16"
    assert out.manifest["splits"]["train"]["documents"] == 41
    starts, lengths = shards.documents()  # document boundaries: each document ends in EOS
    assert shards.read(int(starts[5]), int(lengths[5])).tolist() == tok.encode_documents([a[5]])[0]
    shards.verify()

    prepare([str(tmp_path / "b.parquet")], tok, tmp_path / "b", opts(text_field="body"))
    np.testing.assert_array_equal(stream(tmp_path / "b"), expected(tok, b))


def test_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["<|endoftext|>"] = 70_000
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    info = describe(word_level)
    (tmp_path / "big.txt").write_text("w1 w65535 w65536 w69999")
    out = prepare([str(tmp_path / "big.txt")], info, tmp_path / "s", opts())
    assert out.manifest["dtype"] == "uint32" and token_dtype(65536) == np.uint16
    assert stream(tmp_path / "s").tolist() == [1, 65535, 65536, 69999, 70_000]


def test_held_out_split_partitions_the_documents(tmp_path, tok):
    docs = texts(200, 4)
    write_jsonl(tmp_path / "a.jsonl", docs)
    out = prepare([str(tmp_path / "a.jsonl")], tok, tmp_path / "s", opts(val_fraction=0.2))
    n_train, n_val = (out.manifest["splits"][s]["documents"] for s in ("train", "val"))
    assert n_train + n_val == 200 and 20 <= n_val <= 60
    both = np.concatenate([stream(tmp_path / "s", "train"), stream(tmp_path / "s", "val")])
    assert sorted(both.tolist()) == sorted(expected(tok, docs).tolist())


def test_rerun_on_same_inputs_is_a_noop_and_a_changed_input_is_redone(tmp_path, tok):
    src = write_jsonl(tmp_path / "a.jsonl", texts(20))
    first = prepare([str(src)], tok, tmp_path / "s", opts())
    stamp = os.stat(tmp_path / "s" / "manifest.json").st_mtime_ns
    again = prepare([str(src)], tok, tmp_path / "s", opts())
    assert not first.reused and again.reused
    assert os.stat(tmp_path / "s" / "manifest.json").st_mtime_ns == stamp
    write_jsonl(src, texts(25, seed=5))
    redone = prepare([str(src)], tok, tmp_path / "s", opts())
    assert not redone.reused and redone.manifest["splits"]["train"]["documents"] == 25


def test_worker_processes_write_the_same_shards_as_one_process(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(prepare_module, "_CHUNK_CHARS", 2000)  # several chunks across workers
    src = write_jsonl(tmp_path / "a.jsonl", texts(300))
    one = prepare([str(src)], tok, tmp_path / "one", opts())
    two = prepare([str(src)], tok, tmp_path / "two", PrepareOptions(progress=False, workers=2))
    assert [s["sha256"] for s in one.manifest["splits"]["train"]["shards"]] == \
           [s["sha256"] for s in two.manifest["splits"]["train"]["shards"]]


def test_crash_midway_leaves_no_finished_looking_output_and_keeps_the_old_one(tmp_path, tok, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", texts(50))
    prepare([str(src)], tok, tmp_path / "s", opts(shard_tokens=100))
    old = stream(tmp_path / "s")
    write_jsonl(src, texts(60, seed=7))
    real_add = prepare_module._ShardWriter.add
    calls = []

    def dying_add(self, ids, score):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt  # as if killed mid-write
        real_add(self, ids, score)

    monkeypatch.setattr(prepare_module._ShardWriter, "add", dying_add)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(src)], tok, tmp_path / "s", opts(shard_tokens=100))
    np.testing.assert_array_equal(stream(tmp_path / "s"), old)  # the finished output is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "s"]  # nothing half-written

    # SIGKILL mid-write (no cleanup runs): the staging directory stays, is never read as
    # finished, and the rerun clears it and completes.
    monkeypatch.undo()
    save_tokenizer(tok, tmp_path / "tok")
    script = f"""
import os, signal
from kiln.data import prepare as p
from kiln.data.tokenizer import load_tokenizer
real, n = p._ShardWriter.add, [0]
def add(self, ids, score):
    n[0] += 1
    if n[0] == 30:
        os.kill(os.getpid(), signal.SIGKILL)
    real(self, ids, score)
p._ShardWriter.add = add
p.prepare([{str(src)!r}], load_tokenizer({str(tmp_path / "tok")!r}), {str(tmp_path / "fresh")!r},
          p.PrepareOptions(progress=False, workers=1, shard_tokens=100))
"""
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    assert len(list((tmp_path / ".fresh.partial").glob("train-*.bin"))) > 1
    with pytest.raises(KilnError, match="interrupted prepare"):
        ShardSet(tmp_path / "fresh")
    prepare([str(src)], tok, tmp_path / "fresh", opts())
    assert not (tmp_path / ".fresh.partial").exists()
    assert read_manifest(tmp_path / "fresh")["splits"]["train"]["documents"] == 60


def test_truncated_shard_is_refused(tmp_path, tok):
    prepare([str(write_jsonl(tmp_path / "a.jsonl", texts(20)))], tok, tmp_path / "s", opts())
    with open(tmp_path / "s" / "train-00000.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(KilnError, match="train-00000.bin has 10 bytes"):
        ShardSet(tmp_path / "s")


def test_bad_json_line_names_file_and_line_and_can_be_skipped_and_counted(tmp_path, tok):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "alpha beta"}\n{"text": "gamma"\n{"txt": "delta"}\n{"text": "mu"}\n')
    with pytest.raises(KilnError, match=r"a\.jsonl, line 2, column \d+: not valid JSON"):
        prepare([str(src)], tok, tmp_path / "s", opts())
    assert not (tmp_path / "s").exists() and not (tmp_path / ".s.partial").exists()
    out = prepare([str(src)], tok, tmp_path / "s", opts(skip_bad_records=True))
    assert out.stats.bad_records == 2 and out.manifest["bad_records"] == 2
    assert "line 3: no text field 'text'" in out.stats.bad_examples[1]
    np.testing.assert_array_equal(stream(tmp_path / "s"), expected(tok, ["alpha beta", "mu"]))


@pytest.mark.parametrize("case", ["missing", "empty", "column", "field"])
def test_bad_inputs_raise_clear_errors_and_write_nothing(tmp_path, tok, case):
    if case == "missing":
        inputs, pattern = [str(tmp_path / "nope.jsonl")], "nope.jsonl does not exist"
    elif case == "empty":
        (tmp_path / "e.txt").write_text("")
        inputs, pattern = [str(tmp_path / "e.txt")], "e.txt is empty"
    elif case == "column":
        pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
        inputs, pattern = [str(tmp_path / "p.parquet")], "has no column 'text' .*body"
    else:
        write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
        inputs, pattern = [str(tmp_path / "a.jsonl")], "line 1: no text field 'text'.*content"
    with pytest.raises(KilnError, match=pattern):
        prepare(inputs, tok, tmp_path / "s", opts())
    assert not (tmp_path / "s").exists() and not (tmp_path / ".s.partial").exists()


def test_model_directory_tokenizer_gives_bos_eos_and_chat_template(tmp_path, tok):
    model_dir = tmp_path / "model"
    save_tokenizer(tok, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(bos_token={"content": "<|endoftext|>"}, add_bos_token=True,
                  chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    info = load_tokenizer(model_dir)
    assert info.chat_template.startswith("{% for") and info.bos_id == info.eos_id == tok.eos_id
    assert info.encode_documents(["alpha"])[0][0] == info.bos_id
    (tmp_path / "lone.json").write_text((model_dir / "tokenizer.json").read_text())
    assert load_tokenizer(tmp_path / "lone.json").bos_id is None  # no config beside it: no BOS
    with pytest.raises(KilnError, match="holds no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_cli_tokenizer_train_then_prepare_then_rerun_and_a_bad_line_without_traceback(tmp_path, capsys):
    from kiln.cli import main

    src = write_jsonl(tmp_path / "a.jsonl", texts(100))
    assert main(["tokenizer", "train", str(src), "--out", str(tmp_path / "tok"),
                 "--vocab-size", "280"]) == 0
    assert load_tokenizer(tmp_path / "tok").vocab_size == 280
    args = ["prepare", str(src), "--out", str(tmp_path / "s"), "--tokenizer", str(tmp_path / "tok"),
            "--val-fraction", "0.1", "--workers", "1"]
    assert main(args) == 0 and "100 documents" in capsys.readouterr().out
    assert main(args) == 0 and "nothing to do" in capsys.readouterr().out
    with open(src, "a") as f:
        f.write("{not json}\n")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a.jsonl, line 101, column 2: not valid JSON" in err and "Traceback" not in err
    assert main(args + ["--skip-bad-records"]) == 0
    assert "skipped 1 bad records" in capsys.readouterr().out


def test_directory_input_picks_up_compressed_jsonl_and_text_in_sorted_order(tmp_path, tok):
    import gzip

    a, b = texts(10, 11), texts(1, 12)
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in a))
    (tmp_path / "in" / "b.txt").write_text(b[0])
    (tmp_path / "in" / "notes.bin").write_bytes(b"\xff\x00")  # not a known text format: skipped
    prepare([str(tmp_path / "in")], tok, tmp_path / "s", opts())
    np.testing.assert_array_equal(stream(tmp_path / "s"), expected(tok, a + b))


def test_missing_source_directory_names_the_config_key(tmp_path):
    from conftest import tiny_job
    from kiln.data.pipeline import build_data

    cfg = tiny_job(tmp_path, data=dict(source="shards", max_bytes=None, tokenizer=None,
                                       sources=[dict(name="web", path=str(tmp_path / "nope"))],
                                       val=[dict(name="web", path=str(tmp_path / "nope"))]))
    with pytest.raises(KilnError, match="data.sources 'web': .*nope is not a prepared shard directory"):
        build_data(cfg, tmp_path / "run")
