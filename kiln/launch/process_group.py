"""The default process group of a job started by torchrun (or a cluster launcher that sets
the same environment): created from the environment, destroyed at exit."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from contextlib import contextmanager
from datetime import timedelta
from collections.abc import Iterator


def env_rank_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as the launcher set them; (0, 1) when started without one."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def rank_label() -> str:
    """' (rank R of N)' under a launcher with several processes, '' otherwise: error messages
    carry it so a user can tell which process failed."""
    rank, world = env_rank_world()
    return f" (rank {rank} of {world})" if world > 1 else ""


# What gloo's collectives raise when the process at the other end is gone.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer(error: BaseException) -> str | None:
    """A one-paragraph message when error is a collective failing because another process of
    the job died (killed, out of memory, its own error): not a bug here, and what to look at;
    None for anything else."""
    _, world = env_rank_world()
    if world == 1 or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    gone = next((s for s in _PEER_GONE if s in text), None)
    if gone is None:
        return None
    first = text[:text.index(gone) + len(gone)].strip()[-300:]  # gloo's own advice cut off
    return (f"lost contact with another process of the job ({first}). That process stopped "
            f"first (killed, out of memory, or its own error, shown above or in its log); this "
            f"one cannot go on without it. Under torchrun --max-restarts (or a launcher's "
            f"restart policy) the job restarts and resumes from its last committed checkpoint")


@contextmanager
def process_group(device_type: str, timeout_s: float = 1800.0) -> Iterator[None]:
    """Initialise the default process group from torchrun's environment for the block:
    NCCL (RCCL on AMD, the same backend) for CUDA tensors with gloo beside it for CPU tensors,
    gloo alone on the CPU. Nothing when the job is one process.

    Ranks other than 0 print nothing on stdout and show no warnings; errors still reach stderr.
    """
    import torch
    import torch.distributed as dist

    _, world = env_rank_world()
    if world == 1 or dist.is_initialized():
        yield
        return
    rank = int(os.environ["RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    stdout = sys.stdout
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
        warnings.simplefilter("ignore")
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout, **_attempt_store(world, timeout))
    try:
        yield
    finally:
        if rank != 0:
            sys.stdout.close()
            sys.stdout = stdout
        # Models, meshes and autograd graphs hold the groups; free them (cycles included) while
        # the groups still exist, so none is torn down at interpreter exit, where gloo can abort.
        gc.collect()
        dist.destroy_process_group()


def _attempt_store(world: int, timeout: timedelta) -> dict:
    """The store of this torchrun attempt, when torchrun restarted the workers.

    torchrun (2.4 and later) keeps one TCPStore server for the whole launch and its workers use
    it without a per-attempt prefix, so workers restarted after a failure (--max-restarts)
    read the addresses the dead ones published and fail to connect ("Gloo connectFullMesh
    failed ... Connection refused"; pytorch issue 167288). Keys under
    /worker/attempt_<TORCHELASTIC_RESTART_COUNT> (what torchrun itself did before 2.4) keep
    each attempt to its own. Empty (the environment's store as is) outside torchrun's agent
    store."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"/worker/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": world}
