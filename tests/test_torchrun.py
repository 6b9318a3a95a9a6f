"""Launching a job on several processes through the real CLI: two torchrun agents forming one
job over c10d rendezvous (two "nodes" on this machine), and layouts that cannot work failing
with one clear line per rank and no traceback."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import yaml

from conftest import failure, finish, start, tiny_job
from kiln.checkpoint.storage import Storage

RUN = [sys.executable, "-m", "torch.distributed.run"]


def job_file(tmp_path: Path, name: str, **sections) -> Path:
    base = dict(name=name, train={"micro_batch_size": 4, "global_batch_size": 16, "max_steps": 4,
                                  "log_interval": 2, "eval_interval": 100, "eval_batches": 1,
                                  "sample_tokens": 0, "num_threads": 1, "device": "cpu"},
                data={"max_bytes": 200_000}, checkpoint={"interval": 2, "keep_last": None})
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_job(tmp_path, **base).model_dump(mode="json", by_alias=True)))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_and_checkpoint_one_job(tmp_path):
    config = job_file(tmp_path, "two_nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [start([*RUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint={endpoint}", "--rdzv-id=kiln-test", "-m", "kiln", "train",
                     str(config), "--resume", "none"]) for _ in range(2)]
    outputs = []
    for agent in agents:
        code, output = finish(agent, timeout=300)
        assert code == 0, failure(output)
        outputs.append(output)
    # One process (rank 0, on whichever node the rendezvous made first) prints; the other is silent.
    printed = [o for o in outputs if "kiln: 4 steps" in o]
    assert len(printed) == 1 and not any("step=2 loss=" in o for o in outputs if o is not printed[0])
    run = tmp_path / "runs" / "two_nodes"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]
    # Per-rank health: both ranks' step times and memory, the slowest named.
    assert all(r["slowest_rank"] in (0, 1) and len(r["peak_mem_mb_per_rank"]) == 2
               and 0 < r["step_time_median_s"] <= r["step_time_max_s"] for r in steps)
    committed = Storage(str(run / "checkpoints")).committed()
    assert [c.step for c in committed] == [2, 4]
    assert all(c.marker["world_size"] == 2 for c in committed)
    assert (run / "model.safetensors").is_file()


BAD = {
    "product": ({"parallel": {"dp_shard": 4}}, "needs 4 processes, but the job has 2"),
    "kv_heads": ({"parallel": {"tp": 2}, "model": {"n_kv_heads": 1}}, "parallel.tp=2 must divide"),
    "pp_layers": ({"parallel": {"pp": 2}, "model": {"n_layers": 1}}, "the model has only 1 layers"),
    "cp_on_cpu": ({"parallel": {"cp": 2}}, "context parallel (ring attention) runs only on CUDA"),
}


def test_impossible_layouts_are_one_clear_error_per_rank(tmp_path):
    """Under torchrun, each rank's own output (torchrun --redirects) is the error naming its
    rank, before any process group or data; the exit code is not 0. Launched together."""
    launches = {}
    for name, (sections, _) in BAD.items():
        logs = tmp_path / f"logs-{name}"
        launches[name] = (logs, start([*RUN, "--standalone", "--nproc-per-node=2", "--redirects=3",
                                       f"--log-dir={logs}", "-m", "kiln", "train",
                                       str(job_file(tmp_path, name, **sections)), "--resume", "none"]))
    for name, (logs, proc) in launches.items():
        code, output = finish(proc, timeout=180)
        assert code != 0, output[-2000:]
        said = 0
        for rank in (0, 1):
            (err,) = logs.rglob(f"attempt_0/{rank}/stderr.log")
            text = err.read_text() + (err.parent / "stdout.log").read_text()
            assert "Traceback" not in text, (name, text)
            # torchrun stops the other worker as soon as one fails: a rank slower to get there
            # may be stopped before it says anything, but never says anything else.
            if text.strip():
                assert f"kiln: error (rank {rank} of 2): parallel" in text and BAD[name][1] in text, (name, text)
                said += 1
        assert said >= 1, name
        assert not (tmp_path / "runs" / name).exists()  # nothing was started


def test_nproc_checks_the_layout_before_starting_processes(tmp_path):
    config = job_file(tmp_path, "bad", parallel={"tp": 4})
    code, output = finish(start([sys.executable, "-m", "kiln", "train", str(config), "--nproc", "2"]),
                          timeout=120)
    assert code == 2 and "Traceback" not in output
    assert output.strip().startswith("kiln: error: parallel:") and output.count("kiln: error") == 1
