"""Checkpoints: exact resume after SIGKILL, crashes mid-save, torn and tampered steps, retention,
async saves, config changes on resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_job
from kiln.checkpoint.checkpointer import find_checkpoint
from kiln.checkpoint.storage import MARKER, Storage
from kiln.errors import KilnError
from kiln.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
# A constant LR after warmup: the schedule does not depend on max_steps, so a run cut short
# and resumed with a different budget follows the same curve as one that never stopped.
FAST = dict(schedule={"kind": "constant", "warmup_steps": 3},
            data={"max_bytes": 150_000, "seq_len": 16})


def job(tmp_path, steps, interval=3, **sections):
    train_cfg = {"max_steps": steps, "micro_batch_size": 4, "sample_tokens": 0,
                 "eval_interval": 1000, "log_interval": 3, **sections.pop("train", {})}
    ckpt = {"interval": interval, "keep_last": None, **sections.pop("checkpoint", {})}
    return tiny_job(tmp_path, train=train_cfg, checkpoint=ckpt, **{**FAST, **sections})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted 12-step run, committed checkpoints at steps 3, 6, 9 and 12."""
    cfg = job(tmp_path_factory.mktemp("reference"), steps=12)
    return cfg, train(cfg)


def copy_run(reference, tmp_path):
    cfg, _ = reference
    shutil.copytree(cfg.run_dir.parent.parent, tmp_path, dirs_exist_ok=True)
    return tmp_path


def start_cli(cfg, tmp_path, prelude: str = "") -> subprocess.Popen:
    """`kiln train` in a child process (optionally after `prelude` Python), to be killed."""
    path = tmp_path / "job.yaml"
    path.write_text(cfg.to_yaml())
    code = f"{prelude}\nimport sys\nfrom kiln.cli import main\nsys.exit(main(['train', {str(path)!r}]))"
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read().decode()[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {path}")
        time.sleep(0.02)


def sigkill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


def weights(cfg) -> dict:
    return load_file(cfg.run_dir / "model.safetensors")


def records(cfg) -> list[dict]:
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


# Runs in the child before `kiln train`: the save of step 6 hangs after its data files are
# written, before DCP's .metadata and our commit marker, until the test kills the process.
HANG_IN_SAVE = """
import time, torch.distributed.checkpoint as dcp
finish = dcp.FileSystemWriter.finish
def hanging_finish(self, *args, **kwargs):
    if str(self.path).endswith("step-000006"):
        open(str(self.path) + ".in-save", "w").close()
        time.sleep(600)
    return finish(self, *args, **kwargs)
dcp.FileSystemWriter.finish = hanging_finish
"""


def test_resume_after_sigkill_mid_save_continues_same_losses(tmp_path, reference):
    ref_cfg, ref = reference
    # A run that would go on for 1000 steps, killed without warning (SIGKILL) while the
    # checkpoint of step 6 is half written; step 3 is the last committed one.
    killed = job(tmp_path, steps=1000)
    proc = start_cli(killed, tmp_path, HANG_IN_SAVE)
    ckpts = killed.run_dir / "checkpoints"
    wait_for(ckpts / "step-000006.in-save", proc)
    sigkill(proc)
    assert (ckpts / "step-000006/__0_0.distcp").is_file()  # data written, never committed
    storage = Storage(str(ckpts))
    assert [c.step for c in storage.committed()] == [3]
    assert storage.uncommitted_steps() == [6]

    resumed = train(job(tmp_path, steps=12))  # --resume auto is the default
    assert resumed.start_step == 3  # the torn step 6 is never read
    assert resumed.losses == ref.losses[3:]  # bit-for-bit: float32 on CPU
    got, want = weights(killed), weights(ref_cfg)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert [c.step for c in storage.committed()] == [3, 6, 9, 12]  # step 6 saved again, whole
    assert storage.uncommitted_steps() == []
    lines = records(killed)
    assert lines[0]["step"] == 0  # metrics.jsonl was appended to, not restarted
    resume_line = next(r for r in lines if "resumed_from" in r)
    assert resume_line["step"] == 3
    assert resume_line["config_changes"] == {"train.max_steps": [1000, 12]}


def test_truncated_or_tampered_checkpoint_is_skipped(reference, tmp_path, capsys):
    _, ref = reference
    cfg = job(copy_run(reference, tmp_path), steps=12)
    ckpts = cfg.run_dir / "checkpoints"
    # Same size, different bytes: only the checksum tells; --resume auto falls back to step 9.
    data = ckpts / "step-000012/__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert [c.step for c in Storage(str(ckpts)).committed()] == [3, 6, 9, 12]
    result = train(cfg)
    assert result.start_step == 9 and result.losses == ref.losses[9:]
    assert "skipping checkpoint" in capsys.readouterr().out

    # A truncated file makes its step invalid at listing time already.
    data = ckpts / "step-000006/__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    assert [c.step for c in Storage(str(ckpts)).committed()] == [3, 9, 12]
    with pytest.raises(KilnError, match="not a committed checkpoint"):
        train(cfg, resume=str(ckpts / "step-000006"))


def test_changed_model_shape_is_a_clear_error(reference, tmp_path):
    wider = job(copy_run(reference, tmp_path), steps=14, model={"intermediate_size": 192})
    with pytest.raises(KilnError, match=r"different model shape.*layers\.0\.mlp\.(gate|up|down)\.weight"):
        train(wider)


def test_safe_change_lower_lr_is_applied_and_recorded(reference, tmp_path):
    lower = job(copy_run(reference, tmp_path), steps=14, optim={"lr": 1e-3})
    result = train(lower)
    assert result.start_step == 12 and len(result.losses) == 2
    lines = records(lower)
    change = next(r for r in lines if "resumed_from" in r)["config_changes"]
    assert change["optim.lr"] == [1e-2, 1e-3] and change["train.max_steps"] == [12, 14]
    assert not any(key.startswith("model.") for key in change)
    assert [r["lr"] for r in lines if "lr" in r][-1] == pytest.approx(1e-3)


def test_explicit_resume_path_and_resume_none(reference, tmp_path):
    _, ref = reference
    cfg = job(copy_run(reference, tmp_path), steps=5)
    result = train(cfg, resume=str(cfg.run_dir / "checkpoints/step-000003"))
    assert result.start_step == 3 and result.losses == ref.losses[3:5]
    with pytest.raises(KilnError, match="already holds checkpoints"):
        train(cfg, resume="none")


def test_finished_run_resumed_does_no_more_steps(reference, tmp_path):
    result = train(job(copy_run(reference, tmp_path), steps=12))
    assert result.start_step == 12 and result.losses == [] and result.val_losses


def test_async_save_with_retention_gives_same_run_and_commits(reference, tmp_path):
    _, ref = reference
    cfg = job(tmp_path, steps=12, checkpoint={"async": True, "keep_last": 2, "keep_every": 6})
    result = train(cfg)
    assert result.losses == ref.losses  # saving in the background changes nothing
    # The newest two plus every multiple of 6; the final save was waited for and committed.
    assert [c.step for c in Storage(str(cfg.run_dir / "checkpoints")).committed()] == [6, 9, 12]
    found, _ = find_checkpoint(str(cfg.run_dir / "checkpoints"))
    assert found.step == 12


def test_retention_never_deletes_before_a_newer_commit(tmp_path):
    storage = Storage(str(tmp_path / "ckpts"))
    for step in (1, 2, 3):
        storage.prepare(step)
        (tmp_path / f"ckpts/step-{step:06d}/data").write_bytes(b"x" * step)
        storage.commit(step, {})
    storage.prepare(4)  # a save in flight: written, not committed
    (tmp_path / "ckpts/step-000004/data").write_bytes(b"y")
    assert storage.apply_retention(3, keep_last=1, keep_every=None) == [1, 2]
    assert [c.step for c in storage.committed()] == [3]
    assert storage.uncommitted_steps() == [4]  # newer than what was committed: left alone


# -- object storage: a local S3-compatible server (moto), with an injected transient failure --

SECRET = "kiln-test-secret-4f1e9c"


class FlakyS3:
    """WSGI middleware: the first upload of a DCP data file is answered 503 SlowDown."""

    def __init__(self, app, failures: int = 1):
        self.app, self.left, self.injected = app, failures, []

    def __call__(self, environ, start_response):
        from werkzeug.wrappers import Request

        path = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] == "PUT" and path.endswith(".distcp") and self.left:
            self.left -= 1
            self.injected.append(path)
            Request(environ).get_data()  # drain the upload, as a real server would
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>")
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(body)))])
            return [body]
        return self.app(environ, start_response)


@pytest.fixture
def s3_server(monkeypatch):
    """moto's S3 on a free loopback port, stopped at the end; credentials only in the env."""
    from moto.moto_server.werkzeug_app import (DomainDispatcherApplication, MotoRequestHandler,
                                               create_backend_app)
    from werkzeug.serving import make_server
    import threading

    app = FlakyS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kiln-test-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    import s3fs

    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).mkdir("ckpts")
    try:
        yield app
    finally:
        server.shutdown()
        thread.join()


def test_s3_save_and_resume_with_a_retried_transient_error(s3_server, reference, tmp_path):
    _, ref = reference
    first = job(tmp_path, steps=6, checkpoint={"dir": "s3://ckpts/run1"})
    train(first)
    assert len(s3_server.injected) == 1  # the first data upload failed once, and was retried
    storage = Storage("s3://ckpts/run1")
    assert [c.step for c in storage.committed()] == [3, 6]

    resumed = train(job(tmp_path, steps=9, checkpoint={"dir": "s3://ckpts/run1"}))
    assert resumed.start_step == 6
    assert resumed.losses == ref.losses[6:9]
    # What --resume s3://.../step-000003 and export-hf look up.
    found, _ = find_checkpoint("s3://ckpts/run1/step-000003")
    assert found.step == 3 and found.url == "s3://ckpts/run1/step-000003"
    # The credentials went nowhere: not into the saved configs, metrics or checkpoints.
    texts = [p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file()]
    texts += [storage.read_text(6, "job.yaml"), storage.read_text(6, MARKER)]
    assert not any(SECRET in t for t in texts)
