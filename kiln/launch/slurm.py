"""An sbatch script for a kiln job: one torchrun agent per node through srun, c10d rendezvous on
the first node, a warning signal before the time limit, and a requeue that resumes the run.

How a stop before the time limit works: Slurm sends SIGUSR1 to the batch shell `signal_seconds`
before the limit (`--signal=B:USR1@S`; `scancel --batch --signal=USR1 JOB` does the same by
hand). The shell sends SIGTERM once to the job step (`scancel --signal=TERM JOB`), which reaches
every torchrun agent and worker; torchrun also forwards it to its workers and waits
TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for them. The trainer checkpoints at the next step
boundary and exits; the shell then requeues the job (`scontrol requeue`), which starts again
with `--resume auto`. Only SIGUSR1 is forwarded: a SIGTERM to the batch shell comes from Slurm
itself (scancel, preemption), which signals the step directly and decides about requeueing.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError
from kiln.launch.common import dns_name, resolve_job

_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2}):(\d{2})$")
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,+-]+$")
# Heredoc delimiter for the embedded job YAML; a job whose YAML contains it is refused.
_EOF = "KILN_JOB_YAML_END"


@dataclass
class SlurmOptions:
    time: str
    """The time limit, [D-]HH:MM:SS."""
    nodes: int = 1
    gpus_per_node: int = 0
    nproc_per_node: int | None = None
    """Processes per node; default: one per GPU."""
    cpus: int | None = None
    """CPUs per node (--cpus-per-task of the one task per node)."""
    partition: str | None = None
    account: str | None = None
    signal_seconds: int = 120
    """How long before the time limit the job is told to checkpoint and stop."""
    max_restarts: int = 3
    """torchrun's --max-restarts: worker restarts inside one allocation."""
    max_requeues: int = 20
    """How many times the job requeues itself after a stop that was not the end of training."""
    python: str = sys.executable
    """The Python on the compute nodes that has kiln and torch (default: this one)."""
    name: str | None = None


@dataclass
class SlurmScript:
    name: str
    run_dir: Path
    text: str


def time_seconds(text: str) -> int:
    m = _TIME.match(text)
    if not m or int(m[3]) >= 60 or int(m[4]) >= 60:
        raise KilnError(f"--time {text!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 48:00:00")
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _check(opts: SlurmOptions) -> int:
    limit = time_seconds(opts.time)
    problems = []
    if opts.nodes < 1:
        problems.append(f"--nodes must be at least 1 (got {opts.nodes})")
    if opts.gpus_per_node < 0:
        problems.append(f"--gpus-per-node must be >= 0 (got {opts.gpus_per_node})")
    nproc = opts.nproc_per_node or opts.gpus_per_node
    if nproc < 1:
        problems.append("give --gpus-per-node G (one process per GPU) or, on CPUs, "
                        "--nproc-per-node P")
    if opts.cpus is not None and opts.cpus < 1:
        problems.append(f"--cpus must be at least 1 (got {opts.cpus})")
    if opts.signal_seconds < 10:
        problems.append(f"--signal-seconds must be at least 10 (got {opts.signal_seconds})")
    elif opts.signal_seconds >= limit:
        problems.append(f"--signal-seconds {opts.signal_seconds} must be shorter than the time "
                        f"limit --time {opts.time} ({limit} s)")
    if opts.max_restarts < 0 or opts.max_requeues < 0:
        problems.append("--max-restarts and --max-requeues must be >= 0")
    for flag, value in (("--partition", opts.partition), ("--account", opts.account)):
        if value is not None and not _SLURM_NAME.match(value):
            problems.append(f"{flag} {value!r} is not a valid Slurm name")
    if opts.name is not None and dns_name(opts.name) != opts.name:
        problems.append(f"--name {opts.name!r}: use lowercase letters, digits and '-'")
    if problems:
        raise KilnError("kiln launch slurm: " + "; ".join(problems) + ".")
    return nproc


def build(job_path: str | Path, overrides: list[str], opts: SlurmOptions,
          log_in_run_dir: bool = False) -> SlurmScript:
    """The sbatch script, with the resolved job YAML inside. The job's output goes to
    kiln-NAME-JOBID.out where sbatch is run, or with log_in_run_dir (for --submit, which
    creates the run directory first) to slurm-JOBID.out in the run directory."""
    nproc = _check(opts)
    # The run directory as an absolute path: the script may be submitted from anywhere, and
    # every node must see it (a shared file system).
    job = resolve_job(job_path, overrides, out_dir=str(Path.cwd()))
    if _EOF in job.yaml:
        raise KilnError(f"the job config contains the text {_EOF}, which the script uses to "
                        f"mark the end of the embedded YAML")
    name = opts.name or dns_name(job.config.name)
    run_dir = job.config.run_dir
    job_file = run_dir / "slurm-job.yaml"
    shutdown = max(opts.signal_seconds - 15, 5)
    sbatch = [f"--job-name=kiln-{name}", f"--nodes={opts.nodes}", "--ntasks-per-node=1",
              f"--time={opts.time}", f"--signal=B:USR1@{opts.signal_seconds}", "--requeue",
              "--open-mode=append",
              f"--output={run_dir / 'slurm-%j.out' if log_in_run_dir else f'kiln-{name}-%j.out'}"]
    if opts.gpus_per_node:
        sbatch.append(f"--gpus-per-node={opts.gpus_per_node}")
    if opts.cpus:
        sbatch.append(f"--cpus-per-task={opts.cpus}")
    if opts.partition:
        sbatch.append(f"--partition={opts.partition}")
    if opts.account:
        sbatch.append(f"--account={opts.account}")
    torchrun = " ".join(shlex.quote(a) for a in (
        opts.python, "-m", "torch.distributed.run", f"--nnodes={opts.nodes}",
        f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--max-restarts={opts.max_restarts}"))
    torchrun += ' --rdzv-endpoint="$head:$port" --rdzv-id="$SLURM_JOB_ID"'
    text = f"""#!/bin/bash
# Written by `kiln launch slurm` for the run {run_dir}:
# {opts.nodes} node(s) x {nproc} process(es), time limit {opts.time}. Submit with: sbatch THIS_FILE
# {opts.signal_seconds} s before the time limit (or on `scancel --batch --signal=USR1 JOBID`) the
# training saves a checkpoint and stops, and the job requeues itself and resumes from it.
{chr(10).join('#SBATCH ' + s for s in sbatch)}
set -uo pipefail

run_dir={shlex.quote(str(run_dir))}
job_file={shlex.quote(str(job_file))}
mkdir -p "$run_dir"
# The resolved job config (written on every start, the same each time).
cat > "$job_file.tmp" <<'{_EOF}'
{job.yaml}{_EOF}
mv "$job_file.tmp" "$job_file"

# c10d rendezvous on the first node; a port of this job's own on a shared node.
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=$((20000 + SLURM_JOB_ID % 20000))
# After SIGTERM torchrun gives its workers this long to checkpoint before it kills them.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown}
export PYTHONUNBUFFERED=1

warned=0
terminated=0
warn() {{
    # Tell every process of the step once (Slurm signals all of them; torchrun forwards it too).
    [ "$warned" = 1 ] && return
    warned=1
    echo "kiln: $1 received: checkpointing, then requeueing"
    scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap 'warn USR1' USR1
trap 'terminated=1' TERM

srun --ntasks-per-node=1 --kill-on-bad-exit=1 \\
    {torchrun} \\
    -m kiln train "$job_file" --resume auto &
step=$!
# bash handles a signal only between commands: wait again after each trap until srun is done.
while :; do
    wait "$step"
    rc=$?
    kill -0 "$step" 2>/dev/null || break
done

if [ "$rc" = 0 ] && [ "$warned" = 0 ]; then
    echo "kiln: training finished"
    exit 0
fi
if [ "$terminated" = 1 ]; then
    echo "kiln: stopped by Slurm (exit $rc); Slurm decides whether the job runs again"
    exit "$rc"
fi
restarts=${{SLURM_RESTART_COUNT:-0}}
if [ "$restarts" -lt {opts.max_requeues} ]; then
    echo "kiln: training stopped (exit $rc); requeueing ($((restarts + 1)) of {opts.max_requeues}) to resume from the last checkpoint"
    scontrol requeue "$SLURM_JOB_ID" && exit 0
fi
echo "kiln: training stopped (exit $rc) and is not requeued again ({opts.max_requeues} requeues)"
exit 1
"""
    return SlurmScript(name, run_dir, text)


def submit(script: SlurmScript) -> tuple[str, Path]:
    """Write the script into the run directory and sbatch it; returns (job id, script path)."""
    if shutil.which("sbatch") is None:
        raise KilnError("--submit: sbatch is not on PATH (run this on a Slurm login node, or "
                        "drop --submit and copy the printed script there)")
    script.run_dir.mkdir(parents=True, exist_ok=True)
    path = script.run_dir / f"kiln-{script.name}.sbatch"
    path.write_text(script.text)
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        raise KilnError(f"sbatch {path} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0], path
