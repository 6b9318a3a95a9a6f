"""Run several training jobs one after another in one torchrun launch (real processes over
gloo), so the parity tests pay for starting processes and importing torch once per world size.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/dist_jobs.py JOBS OUT

JOBS: a JSON list of {"config": <JobConfig dict>, "resume": "none" | "auto" | PATH}.
OUT: rank 0 writes {name: {"losses": [...], "start_step": n}} there.
"""

import json
import sys
import time
from pathlib import Path

from kiln.config import JobConfig
from kiln.launch.process_group import env_rank_world, process_group
from kiln.train.trainer import train

jobs = json.loads(Path(sys.argv[1]).read_text())
results = {}
with process_group("cpu"):
    for job in jobs:
        cfg = JobConfig.model_validate(job["config"])
        start = time.perf_counter()
        result = train(cfg, resume=job.get("resume", "none"))
        results[cfg.name] = {"losses": result.losses, "start_step": result.start_step,
                             "sample": result.sample, "seconds": time.perf_counter() - start}
if env_rank_world()[0] == 0:
    Path(sys.argv[2]).write_text(json.dumps(results))
