"""Hostile but realistic inputs to every kiln command (issue 10).

Each case runs the real CLI, in a child process (`python -m kiln ...`) for everything that once
ended in a traceback, in-process (`kiln.cli.main`) where a child would only cost time, and
asserts four things: a non-zero exit, no traceback, a message that names the culprit (the
file, key, option, URL or device), and that every file present before is byte-identical after.

New commands join this file as they land (launch, eval, adapters, plot): add their hostile
inputs to CASES, or a test of their own below, with the same four assertions.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file, save_model

from kiln.checkpoint.storage import MARKER, Storage
from kiln.cli import main
from kiln.config import JobConfig
from kiln.data.tokenizer import describe, save_tokenizer, train_bpe
from kiln.errors import KilnError
from kiln.models.hf import hf_config_from_model, to_hf_state_dict
from kiln.models.transformer import Transformer

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
MODEL = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, intermediate_size=64, max_seq_len=32)
SECRET = "hostile-secret-7d3a"


BATCH = r"""
import contextlib, io, json, os, sys, traceback
from kiln.cli import main
results = {}
for name, cwd, argv in json.load(open(sys.argv[1])):
    os.chdir(cwd)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's refusals
            code = e.code
        except BaseException:  # what main() let through: one case fails, not the batch
            code = 1
            traceback.print_exc()
    results[name] = [code, out.getvalue()]
json.dump(results, open(sys.argv[2], "w"))
"""


def run_child(cases: list[tuple[str, Path, list]], workdir: Path, env: dict) -> dict:
    """Every case's argv through `kiln.cli.main` in ONE fresh interpreter (torch is imported
    once, not per case): {name: (exit code, stdout + stderr)}, and the child's own output."""
    spec = workdir / "cases.json"
    spec.write_text(json.dumps([[name, str(cwd), [str(a) for a in argv]]
                                for name, cwd, argv in cases]))
    proc = subprocess.run([sys.executable, "-c", BATCH, spec, workdir / "results.json"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((workdir / "results.json").read_text())
    return {name: tuple(r) for name, r in results.items()}, proc.stdout + proc.stderr


def kiln(args: list[str], cwd: Path, env: dict | None = None) -> tuple[int, str]:
    """`python -m kiln ARGS` in a child process: (exit code, stdout + stderr)."""
    proc = subprocess.run([sys.executable, "-m", "kiln", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def kiln_here(args: list[str], capsys) -> tuple[int, str]:
    """The same CLI in this process."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_refused(code: int, out: str, *culprits: str) -> None:
    assert code != 0, out
    assert "Traceback" not in out and "this is a bug in kiln" not in out, out
    assert SECRET not in out, out
    for name in culprits:
        assert name in out, f"{name!r} not named in: {out}"


def assert_kept(before: dict[str, bytes], root: Path) -> None:
    after = snapshot(root)
    for name, data in before.items():
        assert name in after, f"{name} was removed"
        assert after[name] == data, f"{name} was changed"


def job_file(here: Path, name: str = "job.yaml", **sections) -> Path:
    raw = {"name": "j", "out_dir": str(here / "runs"), "model": MODEL,
           "data": {"source": "shards", "seq_len": 16, "tokenizer": str(here / "tok"),
                    "sources": [{"name": "train", "path": str(here / "shards")}],
                    "val": [{"name": "val", "path": str(here / "shards")}]},
           "train": {"max_steps": 2, "micro_batch_size": 2, "eval_batches": 1, "sample_tokens": 0,
                     "num_threads": 1},
           "metrics": {"peak_tflops": 0.1, "progress_bar": "off"}}
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    (here / name).write_text(yaml.safe_dump(raw))
    return here / name


# A run with committed checkpoints at steps 2, 4, 6 and 8, for the resume cases.
TRAINED = dict(train={"max_steps": 8}, checkpoint={"interval": 2, "keep_last": None})


# -- the world the cases damage: a tokenizer, inputs, shards, an HF directory, runs ------------

@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("world")
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, 30)) for _ in range(200)]
    (w / "good.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = describe(train_bpe(docs, 300))
    save_tokenizer(tok, w / "tok")
    assert main(["prepare", str(w / "good.jsonl"), "--tokenizer", str(w / "tok"),
                 "--out", str(w / "shards"), "--val-fraction", "0.2", "--workers", "1"]) == 0

    cfg = JobConfig.model_validate({"model": MODEL, "data": {"seq_len": 16}})
    model = Transformer(cfg.model)
    model.init_weights(0)
    hf = w / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_from_model(cfg.model)))
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(model.state_dict(), False).items()},
              str(hf / "model.safetensors"))
    save_tokenizer(tok, hf)

    run = w / "run"  # a finished run without checkpoints: config.yaml and its final weights
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    save_model(model, str(run / "model.safetensors"))
    save_tokenizer(tok, run)

    # runs/j: committed checkpoints at steps 2, 4, 6, 8 (copied only for the resume case)
    assert main(["train", str(job_file(w, "trained.yaml", **TRAINED))]) == 0
    return w


def fresh(world: Path, into: Path, trained: bool = False) -> Path:
    """A copy of the world for one case to damage (with the trained run if asked)."""
    skip = ("trained.yaml",) if trained else ("trained.yaml", "runs")
    shutil.copytree(world, into, ignore=shutil.ignore_patterns(*skip))
    return into


# -- the cases: (set up the hostile input in `here`, return argv and the names to see) ---------

def _out_holds_inputs(h):
    (h / "c").mkdir()
    (h / "c" / "a.jsonl").write_bytes((h / "good.jsonl").read_bytes())
    (h / "c" / "README.md").write_text("notes\n")
    return ["prepare", h / "c" / "a.jsonl", "--tokenizer", h / "tok", "--out", h / "c"], ["README.md"]


def _out_is_a_file(h):
    (h / "notes.txt").write_text("mine\n")
    return ["prepare", h / "good.jsonl", "--tokenizer", h / "tok", "--out", h / "notes.txt"], ["notes.txt"]


def _out_holds_other_prepare(h):
    (h / "other.jsonl").write_text(json.dumps({"text": "alpha beta"}) + "\n")
    return ["prepare", h / "other.jsonl", "--tokenizer", h / "tok", "--out", h / "shards"], ["other inputs"]


def _import_over_job(h):
    (h / "job.yaml").write_text("name: mine\n")
    return ["import-hf", h / "hf", "--out", h / "job.yaml"], ["job.yaml", "--force"]


def _tokenizer_over_tokenizer(h):
    return ["tokenizer", "train", h / "good.jsonl", "--out", h / "tok", "--vocab-size", "280"], \
        ["tokenizer.json", "--force"]


def _option(command: str, option: str, value: str):
    def case(h):
        head = ["prepare", h / "good.jsonl", "--tokenizer", h / "tok"] if command == "prepare" \
            else ["tokenizer", "train", h / "good.jsonl"]
        return [*head, "--out", h / "o", option, value], [option, value]
    return case


def _binary_config(h):
    (h / "bin.yaml").write_bytes(b"\x00\x01\xff\xfe\x80model: {}")
    return ["config", "show", h / "bin.yaml"], ["bin.yaml", "UTF-8"]


def _latin1_config(h):
    (h / "latin.yaml").write_bytes("name: caf\u00e9\n".encode("latin-1"))
    return ["config", "show", h / "latin.yaml"], ["latin.yaml", "UTF-8"]


def _bad_set(h):
    return ["config", "show", job_file(h), "--set", "optim.lr=[1e-3,"], ["optim.lr", "[1e-3,"]


def _config_is_dir(h):
    return ["config", "show", h / "tok"], [str(h / "tok")]


def _hf_config(data: bytes):
    def case(h):
        (h / "hf" / "config.json").write_bytes(data)
        return ["import-hf", h / "hf"], ["config.json"]
    return case


def _hf_config_lacks(field: str):
    def case(h):
        hf = json.loads((h / "hf" / "config.json").read_text())
        del hf[field]
        (h / "hf" / "config.json").write_text(json.dumps(hf))
        return ["import-hf", h / "hf"], ["config.json", field]
    return case


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _truncated_import(h):
    _truncate(h / "hf" / "model.safetensors")
    return ["import-hf", h / "hf"], ["model.safetensors"]


def _truncated_export(h):
    _truncate(h / "run" / "model.safetensors")
    return ["export-hf", h / "run", h / "out"], ["model.safetensors"]


def _bad_run_config(text: str):
    def case(h):
        (h / "run" / "config.yaml").write_text(text)
        return ["export-hf", h / "run", h / "out"], ["config.yaml"]
    return case


def _config_disagrees_with_weights(h):
    cfg = yaml.safe_load((h / "run" / "config.yaml").read_text())
    cfg["model"]["intermediate_size"] = 96  # edited after the weights were saved
    (h / "run" / "config.yaml").write_text(yaml.safe_dump(cfg))
    return ["export-hf", h / "run", h / "out"], ["config.yaml", "do not fit", "mlp"]


def _export_missing_run(h):
    return ["export-hf", h / "no-such-run", h / "out"], ["no-such-run", "does not exist"]


def _export_into_file(h):
    (h / "out").write_text("mine\n")
    return ["export-hf", h / "run", h / "out"], [str(h / "out")]


def _tokenizer_config(data: bytes):
    def case(h):
        (h / "tok" / "tokenizer_config.json").write_bytes(data)
        return ["prepare", h / "good.jsonl", "--tokenizer", h / "tok", "--out", h / "o"], \
            ["tokenizer_config.json"]
    return case


def _device(name: str):
    def case(h):
        return ["train", job_file(h), "--set", f"train.device={name}"], [f"train.device '{name}'"]
    return case


def _run_dir_is_a_file(h):
    (h / "runs").write_text("mine\n")  # out_dir: runs, a file of that name already there
    return ["train", job_file(h)], [str(h / "runs"), "is a file"]


def _out_dot(h):
    return ["prepare", "good.jsonl", "--tokenizer", "tok", "--out", "."], ["--out ."]


def _corrupted_shard(h):
    shard = h / "shards" / "train-00000.bin"
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[len(ids) // 2] = 60000  # same size, an id far outside the 300-token vocabulary
    ids.tofile(shard)
    return ["train", job_file(h)], ["train-00000.bin", "60000"]


def _missing_bucket(h):
    job = job_file(h, checkpoint={"dir": "s3://no-such-bucket/run"})
    return ["train", job], ["s3://no-such-bucket/run", "does not exist"]


def _credentials(command: str):
    def case(h):
        url = f"s3://hostile-key:{SECRET}@bucket/run"
        return {"resume": ["train", job_file(h), "--resume", f"{url}/step-000002"],
                "export": ["export-hf", url, h / "out"],
                "prepare": ["prepare", f"{url}/a.jsonl", "--tokenizer", h / "tok", "--out", h / "o"],
                }[command], ["s3://bucket/run"]
    return case


CASES = [
    ("prepare-out-holds-inputs", _out_holds_inputs),
    ("prepare-out-is-a-file", _out_is_a_file),
    ("prepare-out-dot", _out_dot),
    ("prepare-out-other-prepare", _out_holds_other_prepare),
    ("import-hf-out-exists", _import_over_job),
    ("tokenizer-out-exists", _tokenizer_over_tokenizer),
    ("val-fraction-above-1", _option("prepare", "--val-fraction", "1.5")),
    ("val-fraction-negative", _option("prepare", "--val-fraction", "-0.1")),
    ("shard-tokens-zero", _option("prepare", "--shard-tokens", "0")),
    ("shard-tokens-negative", _option("prepare", "--shard-tokens", "-5")),
    ("workers-zero", _option("prepare", "--workers", "0")),
    ("vocab-size-zero", _option("tokenizer", "--vocab-size", "0")),
    ("vocab-size-negative", _option("tokenizer", "--vocab-size", "-5")),
    ("config-binary", _binary_config),
    ("config-latin-1", _latin1_config),
    ("config-is-a-directory", _config_is_dir),
    ("set-unparsable", _bad_set),
    ("tokenizer-config-not-utf8", _tokenizer_config(b'{"eos_token": "\xff"}')),
    ("tokenizer-config-a-list", _tokenizer_config(b"[1]")),
    ("hf-config-a-list", _hf_config(b"[1, 2, 3]")),
    ("hf-config-not-utf8", _hf_config(b'{"model_type": "llama\xff"}')),
    ("hf-config-bad-value", _hf_config(json.dumps({"model_type": "llama", "vocab_size": -3,
                                                   "hidden_size": 32, "num_hidden_layers": 2,
                                                   "num_attention_heads": 4,
                                                   "intermediate_size": 64}).encode())),
    ("hf-config-lacks-hidden-size", _hf_config_lacks("hidden_size")),
    ("hf-truncated-safetensors", _truncated_import),
    ("export-truncated-safetensors", _truncated_export),
    ("export-run-config-not-yaml", _bad_run_config("model: [unclosed\n")),
    ("export-run-config-a-list", _bad_run_config("- 1\n- 2\n")),
    ("export-config-disagrees", _config_disagrees_with_weights),
    ("export-missing-run", _export_missing_run),
    ("export-into-a-file", _export_into_file),
    ("shard-corrupted-same-size", _corrupted_shard),
    ("train-out-dir-is-a-file", _run_dir_is_a_file),
    ("device-unavailable", _device("cuda")),
    ("device-unknown", _device("gpu0")),
    ("s3-missing-bucket", _missing_bucket),
    ("s3-credentials-resume", _credentials("resume")),
    ("s3-credentials-export", _credentials("export")),
    ("s3-credentials-prepare", _credentials("prepare")),
    # expert parallelism asked of a dense model; QLoRA over a pipeline (refused before processes start)
    ("parallel-ep-dense-model", lambda h: (["train", job_file(h, parallel={"ep": 2})], ["parallel.ep=2"])),
    ("qlora-over-pipeline", lambda h: (["train", job_file(h, peft={"method": "qlora"}, parallel={"pp": 2}),
                                        "--nproc", "2"], ["qlora", "pp"])),
    # the adapter options: LoRA+ below 1 or with full fine-tuning, DoRA on the embedding, an unknown target
    ("loraplus-below-one", lambda h: (["train", job_file(h, peft={"method": "lora", "loraplus_lr_ratio": 0.5})],
                                      ["loraplus_lr_ratio"])),
    ("loraplus-full", lambda h: (["train", job_file(h, peft={"loraplus_lr_ratio": 16})], ["loraplus_lr_ratio"])),
    ("dora-on-embedding", lambda h: (["train", job_file(h, peft={"method": "dora", "target_modules": ["embed"]})],
                                     ["dora", "embed"])),
    ("unknown-adapter-target", lambda h: (["train", job_file(h, peft={"method": "lora", "target_modules": ["wte"]})],
                                          ["target_modules"])),
    # LoRA's default targets (the MLP's gate/up/down too) on a mixture-of-experts model
    ("lora-on-experts", lambda h: (["train", job_file(h, model={"moe": {"n_experts": 4, "top_k": 2}},
                                                      peft={"method": "lora"})],
                                   ["mixtures of experts", "[q, k, v, o]"])),
]


# Cases whose right outcome is not a refusal; they run in the same child.

def _resume_over_damaged_checkpoints(h):
    ckpts = h / "runs" / "j" / "checkpoints"
    (ckpts / "step-000008" / MARKER).write_text("[1, 2]")  # a list, not an object
    marker = json.loads((ckpts / "step-000006" / MARKER).read_text())
    for meta in marker["files"].values():
        del meta["sha256"]
    (ckpts / "step-000006" / MARKER).write_text(json.dumps(marker))
    next(ckpts.glob("step-000004/*.distcp")).unlink()
    return ["train", job_file(h, **TRAINED)]


def _empty_config(h):
    (h / "empty.yaml").write_text("# nothing yet\n")
    return ["config", "show", h / "empty.yaml"]


def _non_utf8_inputs(h):
    (h / "mixed.txt").write_bytes(b"alpha beta \xff\xfe gamma \x80 delta")
    (h / "half.jsonl").write_bytes(b'{"text": "alpha \\ud800 beta"}\n')  # half a UTF-16 pair
    return ["prepare", h / "mixed.txt", h / "half.jsonl", h / "good.jsonl", "--tokenizer",
            h / "tok", "--out", h / "o"]


OTHERS = {"resume-damaged": _resume_over_damaged_checkpoints, "empty-config": _empty_config,
          "non-utf8-inputs": _non_utf8_inputs}


@pytest.fixture(scope="module")
def s3_server():
    """moto's S3 on a free loopback port for the whole module; credentials only in the env."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "hostile-key", "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    import s3fs

    s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=SECRET, skip_instance_cache=True,
                      client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]}).makedirs(
        "bucket", exist_ok=True)
    try:
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="module")
def outcomes(world, s3_server, tmp_path_factory) -> dict:
    """Every case set up in its own copy of the world, then all run in one child process:
    {name: (exit code, output, directory, culprits, files before)}."""
    base = tmp_path_factory.mktemp("cases")
    setup = {}
    for name, case in CASES:
        h = fresh(world, base / name)
        argv, culprits = case(h)
        setup[name] = (h, argv, culprits, snapshot(h))
    for name, case in OTHERS.items():
        h = fresh(world, base / name, trained=name == "resume-damaged")
        setup[name] = (h, case(h), (), snapshot(h))
    results, child = run_child([(n, h, argv) for n, (h, argv, _, _) in setup.items()], base,
                               s3_server)
    outcomes = {n: (*results[n], h, culprits, before) for n, (h, _, culprits, before) in setup.items()}
    outcomes["child"] = child
    return outcomes


def test_nothing_printed_a_traceback_around_the_cli(outcomes):
    """Worker processes and threads print outside main(): the child's own output is clean."""
    assert "Traceback" not in outcomes["child"], outcomes["child"]


@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_hostile_input_is_one_clear_error_and_changes_nothing(outcomes, name):
    code, out, h, culprits, before = outcomes[name]
    assert_refused(code, out, *culprits)
    assert_kept(before, h)
    assert not (h / "runs").is_dir()  # train: nothing left behind by a run that cannot start


def test_resume_auto_skips_each_damaged_checkpoint_once_with_its_reason(outcomes):
    code, out, h, _, before = outcomes["resume-damaged"]
    assert code == 0 and "Traceback" not in out, out
    ckpts = h / "runs" / "j" / "checkpoints"
    for step, reason in ((8, "is a JSON list"), (6, "without a size and sha256"),
                         (4, ".distcp, listed in its COMMITTED.json, is missing")):
        lines = [ln for ln in out.splitlines() if f"step-{step:06d}" in ln and "skipping" in ln]
        assert len(lines) == 1 and reason in lines[0] and str(ckpts) in lines[0], out
    metrics = [json.loads(ln) for ln in (h / "runs/j/metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_from"] for r in metrics if "resumed_from" in r][-1].endswith("step-000002")
    assert_kept({k: v for k, v in before.items() if k.startswith("shards/")}, h)


def test_empty_config_says_it_takes_the_defaults(outcomes):
    code, out, *_ = outcomes["empty-config"]
    assert code == 0 and "empty.yaml holds no settings" in out, out


def test_non_utf8_bytes_in_inputs_are_counted_and_named(outcomes):
    code, out, h, *_ = outcomes["non-utf8-inputs"]
    assert code == 0, out
    assert "4 invalid UTF-8 bytes" in out and "in 2 files" in out, out
    assert "mixed.txt" in out and "half.jsonl" in out and "good.jsonl" not in out
    assert json.loads((h / "o" / "manifest.json").read_text())["invalid_utf8_bytes"] == 4


@pytest.fixture
def here(world, tmp_path) -> Path:
    return fresh(world, tmp_path / "w")


def test_force_replaces_what_the_refusals_protect(here, capsys):
    (here / "job.yaml").write_text("name: mine\n")
    assert kiln_here(["import-hf", here / "hf", "--out", here / "job.yaml", "--force"], capsys)[0] == 0
    assert yaml.safe_load((here / "job.yaml").read_text())["model"]["init_from"] == str(here / "hf")
    old = (here / "tok" / "tokenizer.json").read_bytes()
    assert kiln_here(["tokenizer", "train", here / "good.jsonl", "--out", here / "tok",
                      "--vocab-size", "280", "--force"], capsys)[0] == 0
    assert (here / "tok" / "tokenizer.json").read_bytes() != old


# -- full disks ----------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs when this process may mount one (root), else None."""
    mount = tmp_path / "disk"
    mount.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)],
                        capture_output=True).returncode == 0 if os.geteuid() == 0 else False
    yield mount if ok else None
    if ok:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_full_disk_during_prepare_is_said_and_the_previous_output_kept(here, small_disk,
                                                                       monkeypatch, capsys):
    out = (small_disk or here) / "shards"
    argv = ["prepare", here / "good.jsonl", "--tokenizer", here / "tok", "--out", out]
    assert kiln_here(argv, capsys)[0] == 0
    before = snapshot(out)
    rng = np.random.default_rng(1)
    with open(here / "good.jsonl", "a") as f:  # the same input, grown past the disk's size
        for words in rng.choice(WORDS, (1200, 300)):
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    if small_disk is None:  # no tmpfs here: the write fails the way a full disk fails it
        from kiln.data import prepare as prepare_module

        def full(self, ids, score):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(prepare_module._ShardWriter, "add", full)
    code, text = kiln_here(argv, capsys)
    assert_refused(code, text, "no space left on the device", str(out))
    assert_kept(before, out)
    assert snapshot(out).keys() == before.keys()
    assert not list(out.parent.glob(".shards.*"))  # no staging left to fill the disk


def test_full_disk_while_checkpointing_is_said(small_disk, tmp_path, monkeypatch):
    storage = Storage(str((small_disk or tmp_path) / "ckpts"))
    storage.prepare(1)
    if small_disk is None:  # no tmpfs here: the write fails the way a full disk fails it
        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(KilnError, match="no space left on the device"):
        storage.write_text(1, "big.bin", "x" * (2 << 20))
    assert not list(Path(storage.path).rglob("*.tmp"))  # no half-written file left
    if small_disk is None:
        return
    # DCP's own writer says a full disk as "unexpected pos 704 vs 598": the device tells.
    other = RuntimeError("unexpected pos 704 vs 598")
    assert storage.save_error(other, 1) is other  # space left: not called a full disk
    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    error = storage.save_error(other, 1)
    assert isinstance(error, KilnError) and "no space left on the device" in str(error)


def test_output_inside_an_input_directory_is_not_read_back(here, capsys):
    (here / "corpus").mkdir()
    shutil.copy(here / "good.jsonl", here / "corpus" / "a.jsonl")
    argv = ["prepare", here / "corpus", "--tokenizer", here / "tok", "--out", here / "corpus" / "prep"]
    assert kiln_here(argv, capsys)[0] == 0
    code, out = kiln_here(argv, capsys)  # the manifest and tokenizer .json files are not inputs
    assert code == 0 and "nothing to do" in out, out


# -- object storage: one clear error, said in seconds, no credentials echoed -----------

@pytest.mark.parametrize("where", ["probe", "upload"])
def test_unreachable_endpoint_and_failed_upload_are_one_error(s3, where):
    import s3fs

    if where == "probe":  # nothing listens on port 9
        storage = Storage("s3://bucket/run", "http://127.0.0.1:9")
    else:  # the bucket goes away between two saves
        s3fs.S3FileSystem(skip_instance_cache=True).makedirs("doomed", exist_ok=True)
        storage = Storage("s3://doomed/run")
        storage.probe()
        s3fs.S3FileSystem(skip_instance_cache=True).rm("doomed", recursive=True)
    start = time.time()
    with pytest.raises(KilnError) as e:
        storage.probe() if where == "probe" else storage.write_text(1, "job.yaml", "name: x\n")
    message = str(e.value)
    assert SECRET not in message
    if where == "probe":
        assert "s3://bucket/run" in message and "cannot connect to the endpoint http://127.0.0.1:9" in message
    else:
        assert "s3://doomed/run" in message and "'doomed' does not exist" in message
    assert time.time() - start < 30  # said in seconds, not after minutes of retries


# -- memory and Ctrl-C -----------------------------------------------------------------------

PEAK = """import sys
from kiln.cli import main
code = main(sys.argv[1:])
status = open("/proc/self/status").read()
print("VmHWM", [l.split()[1] for l in status.splitlines() if l.startswith("VmHWM")][0], code)
"""


def test_one_long_line_without_whitespace_keeps_memory_bounded(here):
    """A 2 MB line without whitespace: ~300 MB more at once in one piece (~6 GB at 50 MB),
    ~40 MB more in pieces."""
    rng = np.random.default_rng(2)
    (here / "long.txt").write_text("".join(rng.choice(list("abcdefgh"), 2_000_000)))
    (here / "short.txt").write_text("abcdefgh" * 100)

    def peak_kb(name: str) -> int:
        proc = subprocess.run([sys.executable, "-c", PEAK, "prepare", name, "--tokenizer", "tok",
                               "--out", f"out-{name}", "--workers", "1"], cwd=here,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = proc.stdout.strip().splitlines()[-1].split()
        assert line[0] == "VmHWM" and line[2] == "0", proc.stdout + proc.stderr
        return int(line[1])

    growth_mb = (peak_kb("long.txt") - peak_kb("short.txt")) / 1024
    assert growth_mb < 120, f"peak memory grew by {growth_mb:.0f} MB for a 2 MB line"


def test_ctrl_c_stops_prepare_workers_without_tracebacks(here):
    rng = np.random.default_rng(3)
    lines = [json.dumps({"text": " ".join(rng.choice(WORDS, 400))}) + "\n" for _ in range(1000)]
    with open(here / "big.jsonl", "w") as f:  # ~5 s of work on a quiet machine: Ctrl-C finds it busy
        for _ in range(16):
            f.writelines(lines)
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "prepare", "big.jsonl", "--tokenizer",
                             "tok", "--out", "big", "--workers", "2"], cwd=here,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            # A test run in the background (`cmd &`) inherits Ctrl-C ignored.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    status = Path(f"/proc/{proc.pid}/status")

    def ignores_ctrl_c() -> bool:  # while it starts its pool (the workers inherit the ignoring)
        try:
            line = next(ln for ln in status.read_text().splitlines() if ln.startswith("SigIgn:"))
        except FileNotFoundError:  # it has already exited
            return False
        return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))

    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and children.exists():
        # The pool's workers are up and the parent listens to Ctrl-C again.
        if len(children.read_text().split()) >= 2 and not ignores_ctrl_c():
            break
        time.sleep(0.05)
    time.sleep(0.3 if children.exists() else 2.0)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "interrupted" in out
    assert not (here / "big").exists() and not list(here.glob(".big.*"))


# The commands the other issues added (launch, plot, eval, lineage, adapters, data show): a bad
# target or option is one clear error, no traceback, and nothing is written.
NEW_COMMANDS = {
    "plot-missing-run": (["plot", "{tmp}/nope", "--out", "{tmp}/p.png"], "nope"),
    "eval-missing-target": (["eval", "{tmp}/nope", "--task", "{tmp}/t.jsonl"], "nope"),
    "lineage-missing": (["lineage", "{tmp}/nope"], "nope"),
    "adapters-missing-dir": (["adapters", "{tmp}/nope"], "nope"),
    "launch-k8s-zero-nodes": (["launch", "k8s", "{tmp}/job.yaml", "--nodes", "0", "--gpus-per-node", "8",
                               "--image", "img:1"], "nodes"),
    "data-show-missing-config": (["data", "show", "{tmp}/missing.yaml"], "missing.yaml"),
}


@pytest.mark.parametrize("name", sorted(NEW_COMMANDS))
def test_new_commands_refuse_bad_input_clearly(name, tmp_path, capsys):
    from kiln.cli import main

    (tmp_path / "job.yaml").write_text("name: j\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv, culprit = NEW_COMMANDS[name]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own range checks
        code = e.code
    out = capsys.readouterr()
    text = out.out + out.err
    assert code not in (0, None), text
    assert "Traceback" not in text and culprit in text, text
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
