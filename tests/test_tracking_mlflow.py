"""MLflow against a real `mlflow server` process (SQLite backend, a free loopback port), with
real training runs.

One server for the module; the outage test stops it and starts it again on the same port and
database, so it runs last. It drives Trackers directly, so the moment of the kill is exact:
after the first point arrived, before the next.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import tiny_job
from kiln.config import MlflowConfig
from kiln.tracking import Trackers
from kiln.tracking.jsonl import read_metrics, series
from kiln.train.trainer import train

mlflow = pytest.importorskip("mlflow")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


class Server:
    def __init__(self, root: Path):
        self.root = root
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        log = open(self.root / "server.log", "ab")
        # A session of its own, so stop() ends the server and its workers together.
        self.proc = subprocess.Popen(
            [str(mlflow_bin), "server", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 120  # 20-25 s on a loaded machine (FACTS.md)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("mlflow server did not answer /health within 120 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # like a crash: no goodbye
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow"))
    srv.start()
    yield srv
    srv.stop()


def job(tmp_path, name: str, uri: str, **train_cfg):
    cfg = tiny_job(tmp_path, name=name, train={**dict(max_steps=10, log_interval=2, eval_interval=5,
                                                        sample_tokens=0), **train_cfg},
                   checkpoint=dict(interval=4))
    tracking = cfg.tracking.model_copy(update={
        "tensorboard": True, "mlflow": MlflowConfig(uri=uri, experiment="kiln-tests")})
    return cfg.model_copy(update={"tracking": tracking})


def client(server) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri=server.uri)


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "mlflow.json").read_text())["run_id"]


def history(server, run_dir: Path, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client(server).get_metric_history(run_id(run_dir), key))


def test_training_run_shows_its_metrics_params_and_lineage_tags_on_the_server(server, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cret-token-value")
    cfg = job(tmp_path, "ml", server.uri)
    train(cfg)
    records = read_metrics(cfg.run_dir)

    c = client(server)
    experiment = c.get_experiment_by_name("kiln-tests")
    run = c.get_run(run_id(cfg.run_dir))
    assert run.info.experiment_id == experiment.experiment_id
    assert run.info.status == "FINISHED" and run.info.run_name == "ml"
    for key in ("loss", "lr", "grad_norm", "val_loss", "tokens_per_s"):
        steps, values = series(records, key)
        assert len(steps) >= 2
        assert history(server, cfg.run_dir, key) == list(zip(steps, values)), key
    assert history(server, cfg.run_dir, "tokens_by_source/stdlib") == [(10, 5120.0)]
    params = run.data.params
    assert params["optim.lr"] == "0.01" and params["model.dim"] == "64"
    assert params["tracking.mlflow.uri"] == server.uri
    tags = run.data.tags
    lineage = json.loads((cfg.run_dir / "lineage.json").read_text())
    assert tags["kiln.config_hash"] == lineage["config_hash"]
    assert tags["kiln.git_commit"] == lineage["code"]["git_commit"]
    assert tags["kiln.data.stdlib.manifest_sha256"] == lineage["data"][0]["manifest_sha256"]
    assert tags["kiln.tokenizer_fingerprint"] == lineage["tokenizer_fingerprint"]
    assert tags["system.torch"].startswith("2.") and tags["system.world_size"] == "1"
    assert {d.dataset.name for d in run.inputs.dataset_inputs} == {"stdlib", "stdlib:val"}
    everything = json.dumps([params, tags]) + (cfg.run_dir / "mlflow.json").read_text()
    assert "s3cret-token-value" not in everything


def test_resumed_run_continues_the_same_runs_without_duplicate_points(server, tmp_path):
    cfg = job(tmp_path, "resumed", server.uri, max_steps=12)
    cfg = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"keep_last": None})})
    train(cfg)
    rid = run_id(cfg.run_dir)
    before = history(server, cfg.run_dir, "loss")
    # As if the run had died after step 12's log line, with step 4 its last good checkpoint:
    # resuming re-runs steps 5-12, whose points MLflow and TensorBoard already hold.
    for step in (8, 12):
        shutil.rmtree(cfg.run_dir / "checkpoints" / f"step-{step:06d}")
    result = train(cfg)
    assert result.start_step == 4 and result.steps == 12
    assert run_id(cfg.run_dir) == rid
    assert history(server, cfg.run_dir, "loss") == before
    assert [s for s, _ in before] == [2, 4, 6, 8, 10, 12]
    assert [s for s, _ in history(server, cfg.run_dir, "val_loss")] == [0, 5, 10, 12]
    assert client(server).get_run(rid).info.status == "FINISHED"
    events = EventAccumulator(str(cfg.run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [2, 4, 6, 8, 10, 12]
    # The re-run steps gave the same losses (resume is exact), so both agree.
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([v for _, v in before], rel=1e-6)


def test_training_against_a_dead_server_finishes_and_warns_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(Trackers, "retry_s", 0.5)
    cfg = job(tmp_path, "dead", "http://127.0.0.1:9", max_steps=6)  # nothing listens on port 9
    result = train(cfg)
    assert result.steps == 6
    err = capfd.readouterr().err
    assert err.count("kiln: warning: mlflow failed") == 1, err
    assert "records were not delivered" in err
    assert series(read_metrics(cfg.run_dir), "loss")[0] == [2, 4, 6]  # all in metrics.jsonl


def test_server_killed_mid_run_warns_once_and_back_fills_when_back(server, tmp_path, monkeypatch,
                                                                   capfd):
    monkeypatch.setattr(Trackers, "retry_s", 1.0)
    # A freshly started server on a loaded machine can take long over its first requests.
    monkeypatch.setattr(Trackers, "close_timeout_s", 240.0)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    cfg = job(tmp_path, "outage", server.uri)
    cfg.run_dir.mkdir(parents=True)
    trackers = Trackers.open(cfg, cfg.run_dir, 0, resumed_step=0)
    trackers.log({"step": 0, "loss": 5.0})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (
            (cfg.run_dir / "mlflow.json").exists()
            and client(server).get_metric_history(run_id(cfg.run_dir), "loss")):
        time.sleep(0.2)
    server.stop()
    start = time.monotonic()
    for step in range(1, 6):
        trackers.log({"step": step, "loss": 5.0 - step / 10})
        time.sleep(0.5)  # a training step: the tracker fails and retries meanwhile
    logging_time = time.monotonic() - start
    assert logging_time < 5.0  # log() never waited for the dead server
    server.start()
    trackers.log({"step": 6, "loss": 4.4})
    trackers.close()
    err = capfd.readouterr().err
    assert err.count("kiln: warning: mlflow failed") == 1, err
    assert "mlflow is back; back-filled" in err
    history = sorted(client(server).get_metric_history(run_id(cfg.run_dir), "loss"),
                     key=lambda m: m.step)
    assert [m.step for m in history] == list(range(7))
    assert history[3].value == pytest.approx(4.7)
