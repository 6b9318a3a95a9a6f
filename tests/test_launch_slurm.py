"""`kiln launch slurm`: the sbatch script (content, `bash -n`, clear errors), and for real on a
one-node Slurm cluster that the fixture starts (scripts/slurm-up.sh, Debian's slurm-wlm + munge;
skipped only where they cannot be installed): a submitted job trains, is warned the way the time
limit warns it, requeues itself and resumes with the losses of an uninterrupted run."""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import torchrun
from kiln.config import load_config
from kiln.errors import KilnError
from kiln.launch import slurm

ROOT = Path(__file__).resolve().parents[1]
SLURM_DIR = os.environ.get("KILN_SLURM_DIR", "/tmp/kiln-slurm")

# 2-layer model, 32-token sequences: a step takes milliseconds, start-up dominates.
TINY = {
    "name": "tiny",
    "model": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  intermediate_size=160, max_seq_len=64),
    "data": dict(seq_len=32, max_bytes=400_000, val_fraction=0.15),
    "optim": dict(lr=1e-2),
    "schedule": dict(warmup_steps=5),
    "train": dict(micro_batch_size=8, max_steps=60, log_interval=1, eval_interval=1000,
                  eval_batches=2, sample_tokens=0, num_threads=1),
    "metrics": dict(peak_tflops=0.1, progress_bar="off"),
    "checkpoint": dict(interval=10, keep_last=None),
}


def write_job(directory: Path, **train) -> Path:
    job = {**TINY, "train": {**TINY["train"], **train}}
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_script_starts_one_torchrun_per_node_with_warning_and_requeue(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path)
    script = slurm.build(job, ["train.max_steps=77"], slurm.SlurmOptions(
        time="2-00:00:00", nodes=4, gpus_per_node=8, partition="gpu", account="team-a"))
    text = script.text
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue",
                 "#SBATCH --partition=gpu", "#SBATCH --account=team-a",
                 "#SBATCH --open-mode=append"):
        assert line in text.splitlines(), line
    assert "srun --ntasks-per-node=1 --kill-on-bad-exit=1" in text
    assert re.search(r"torch\.distributed\.run --nnodes=4 --nproc-per-node=8 "
                     r"--rdzv-backend=c10d --max-restarts=3 "
                     r'--rdzv-endpoint="\$head:\$port" --rdzv-id="\$SLURM_JOB_ID"', text)
    assert '-m kiln train "$job_file" --resume auto' in text
    assert "trap 'warn USR1' USR1" in text and 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=105" in text  # inside the 120 s warning
    # The embedded job loads back into the resolved config, run directory made absolute.
    embedded = text.split("<<'KILN_JOB_YAML_END'\n")[1].split("KILN_JOB_YAML_END\n")[0]
    (tmp_path / "embedded.yaml").write_text(embedded)
    cfg = load_config(tmp_path / "embedded.yaml")
    assert cfg.train.max_steps == 77 and cfg.out_dir == str(tmp_path / "runs")
    assert cfg == load_config(job, ["train.max_steps=77", f"out_dir={tmp_path / 'runs'}"])
    (tmp_path / "job.sbatch").write_text(text)
    check = subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr


def test_cpu_script_has_no_gpu_request(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = slurm.build(write_job(tmp_path), [], slurm.SlurmOptions(
        time="00:30:00", nproc_per_node=2, cpus=2, signal_seconds=60)).text
    assert "--gpus-per-node" not in text and "#SBATCH --cpus-per-task=2" in text
    assert "--nproc-per-node=2" in text and "#SBATCH --signal=B:USR1@60" in text


@pytest.mark.parametrize("kw, message", [
    (dict(time="48h"), "--time '48h': expected HH:MM:SS"),
    (dict(time="00:01:00", signal_seconds=120), "must be shorter than the time limit"),
    (dict(gpus_per_node=0), "give --gpus-per-node G"),
    (dict(nodes=0), "--nodes must be at least 1"),
    (dict(partition="gpu; rm -rf /"), "is not a valid Slurm name"),
])
def test_bad_options_are_one_clear_error(tmp_path, kw, message):
    opts = {"time": "01:00:00", "gpus_per_node": 8, **kw}
    with pytest.raises(KilnError, match=re.escape(message)):
        slurm.build(write_job(tmp_path), [], slurm.SlurmOptions(**opts))


def test_cli_bad_time_is_clear_and_secret_refused(tmp_path):
    job = write_job(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for extra, expected in ((["--time", "tomorrow"], "expected HH:MM:SS"),
                            (["--time", "01:00:00", "--set", "checkpoint.dir=s3://AKIAABCDEFGHIJKLMNOP@b/c"],
                             "credential")):
        done = subprocess.run([sys.executable, "-m", "kiln", "launch", "slurm", str(job),
                               "--nodes", "1", "--gpus-per-node", "8", *extra],
                              capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr
        assert expected in done.stderr and "AKIA" not in done.stderr


# ---- on a real one-node Slurm cluster -------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_env():
    env = {**os.environ, "KILN_SLURM_DIR": SLURM_DIR, "SLURM_CONF": f"{SLURM_DIR}/slurm.conf",
           "PYTHONPATH": str(ROOT)}
    up = subprocess.run(["bash", str(ROOT / "scripts/slurm-up.sh")], env=env,
                        capture_output=True, text=True, timeout=900)
    if up.returncode == 3:
        pytest.skip(f"no Slurm cluster can be started here: {up.stderr.strip()}")
    assert up.returncode == 0, up.stdout + up.stderr
    yield env
    if "already running" not in up.stdout:  # leave a cluster someone else started
        subprocess.run(["bash", str(ROOT / "scripts/slurm-down.sh")], env=env, timeout=180)


def job_info(job_id: str, env) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, env=env, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(job_id: str, env, until, what: str, timeout: float = 420) -> dict[str, str]:
    """Poll the job until until(info) is true. A requeued job is held back for two minutes
    (Slurm's BeginTime after a requeue); as an administrator would, start it now instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(job_id, env)
        if until(info):
            return info
        if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            raise AssertionError(f"job {job_id} ended {info['JobState']} waiting for {what}")
        if info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env,
                           timeout=30)
        time.sleep(1)
    raise AssertionError(f"job {job_id}: no {what} within {timeout} s: {info}")


def losses(metrics: Path) -> dict[int, float]:
    """Training loss by step; a step run twice (before and after a resume) must agree."""
    seen: dict[int, float] = {}
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            step = record["step"]
            assert seen.setdefault(step, record["loss"]) == record["loss"], f"step {step} differs"
    return seen


def submit(job: Path, cwd: Path, env, *extra: str) -> str:
    done = subprocess.run([sys.executable, "-m", "kiln", "launch", "slurm", str(job),
                           "--nodes", "1", "--time", "00:20:00", "--signal-seconds", "60",
                           "--python", sys.executable, "--submit", *extra],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "submitted Slurm job" in done.stderr
    return done.stdout.strip()


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1])
                  for p in (run_dir / "checkpoints").glob("step-*/COMMITTED.json"))


def test_warned_job_checkpoints_requeues_and_resumes_same_losses(slurm_env, tmp_path):
    """The time-limit path for real: the batch shell gets SIGUSR1 (what --signal=B:USR1@S sends),
    the training stops, the job requeues itself and resumes from its last committed checkpoint;
    every step's loss equals that of an uninterrupted run of the same job. The job is long
    (steps take milliseconds) so that the warning lands well before its end on a slow machine."""
    steps = 300
    job = write_job(tmp_path, max_steps=steps)
    run_dir = tmp_path / "runs" / "tiny"
    job_id = submit(job, tmp_path, slurm_env, "--nproc-per-node", "1", "--cpus", "1")
    # The same job, uninterrupted, outside Slurm (meanwhile, on the other core).
    reference = subprocess.Popen(
        [sys.executable, "-m", "kiln", "train", str(job), "--set", "name=reference"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "reference.err").open("w"), cwd=tmp_path,
        env=slurm_env)
    try:
        wait_for(job_id, slurm_env, lambda i: len(committed_steps(run_dir)) >= 2,
                 "two committed checkpoints")
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_env,
                       check=True, timeout=30)
        info = wait_for(job_id, slurm_env, lambda i: i.get("JobState") == "COMPLETED"
                        and i.get("Restarts") == "1", "completion after one requeue")
    except BaseException:
        reference.kill()
        raise
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env, timeout=30)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "USR1 received: checkpointing, then requeueing" in log
    assert "requeueing (1 of 20)" in log and "kiln: training finished" in log, log[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if "resumed_from" in r]
    assert len(resumed) == 1 and 0 < resumed[0]["step"] < steps
    assert info["Restarts"] == "1"

    assert reference.wait(timeout=600) == 0, (tmp_path / "reference.err").read_text()[-3000:]
    expected = losses(tmp_path / "runs" / "reference" / "metrics.jsonl")
    assert losses(run_dir / "metrics.jsonl") == expected
    assert sorted(expected) == list(range(1, steps + 1))


def test_two_process_job_trains_to_completion(slurm_env, tmp_path):
    job = write_job(tmp_path, max_steps=30)
    run_dir = tmp_path / "runs" / "tiny"
    job_id = submit(job, tmp_path, slurm_env, "--nproc-per-node", "2", "--cpus", "2",
                    "--max-restarts", "0")
    try:
        wait_for(job_id, slurm_env, lambda i: i.get("JobState") == "COMPLETED", "completion")
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env, timeout=30)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "kiln: training finished" in log and "exitcode" not in log, log[-3000:]
    assert sorted(losses(run_dir / "metrics.jsonl")) == list(range(1, 31))  # rank 0 logs once
    assert committed_steps(run_dir)[-1] == 30


def test_sigterm_to_two_process_job_checkpoints_at_that_step_and_resumes_same_losses(
        slurm_env, tmp_path):
    """`scancel --signal=TERM` (every process of the step) at a random step: all ranks agree at
    the next step boundary, commit a checkpoint there and exit; the job requeues itself and the
    resumed run's losses equal an uninterrupted 2-process run's."""
    seed = int(os.environ.get("KILN_TEST_SEED", time.time_ns() % 1_000_000))
    steps = 160  # long after the signal: it lands mid-run on a slow machine too
    job = write_job(tmp_path, max_steps=steps)
    run_dir = tmp_path / "runs" / "tiny"
    job_id = submit(job, tmp_path, slurm_env, "--nproc-per-node", "2", "--cpus", "2")
    at = random.Random(seed).randint(12, 40)
    why = f"(seed {seed}: KILN_TEST_SEED replays it; signalled at step {at})"
    try:
        wait_for(job_id, slurm_env, lambda i: (run_dir / "metrics.jsonl").exists()
                 and max(losses(run_dir / "metrics.jsonl"), default=0) >= at, f"step {at}")
        subprocess.run(["scancel", "--signal=TERM", job_id], env=slurm_env, check=True,
                       timeout=30)
        wait_for(job_id, slurm_env, lambda i: i.get("JobState") == "COMPLETED"
                 and i.get("Restarts") == "1", "completion after one requeue")
    finally:
        subprocess.run(["scancel", job_id], env=slurm_env, timeout=30)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (stop,) = [i for i, r in enumerate(records) if "preempted" in r]
    stopped = records[stop]["step"]
    assert max(r["step"] for r in records[:stop] if "loss" in r) == stopped >= at, why
    assert stopped in committed_steps(run_dir), why  # the checkpoint is at the step it stopped
    assert [r["step"] for r in records if "resumed_from" in r] == [stopped], why
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    # Both ranks stopped the clean way (torchrun's agent reports the signal it got itself).
    assert log.count(f"SIGTERM: checkpoint of step {stopped} committed") == 2, log[-3000:]
    assert "requeueing (1 of 20)" in log and "kiln: training finished" in log, log[-3000:]
    torchrun(["-m", "kiln", "train", str(job), "--set", "name=reference",
              "--set", f"out_dir={tmp_path / 'runs'}"], timeout=600)
    assert losses(run_dir / "metrics.jsonl") == losses(
        tmp_path / "runs" / "reference" / "metrics.jsonl")
