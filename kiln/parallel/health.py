"""Per-rank health for the metrics line: each rank's step time and peak memory, gathered once
per log interval (one all-gather of two numbers per rank), so a straggler is named.

A rank's step time is its own time per step in the interval, from fetching the batch to the
end of its optimizer step call, host side. Collectives keep the ranks in step, so a rank slowed
outside them (data loading, a busy host, a slow disk) shows as the slowest; a slow device or
link mostly raises every rank's time, as all of them wait for it.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


def rank_health(step_time_s: float, peak_mem_mb: float, device: torch.device) -> dict:
    """{'slowest_rank', 'step_time_max_s', 'step_time_median_s', 'peak_mem_mb_per_rank'} over
    every rank of the job; {} in one process. Every rank must call it at the same step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return {}
    mine = torch.tensor([step_time_s, peak_mem_mb], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    times = [t[0].item() for t in every]
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"slowest_rank": slowest, "step_time_max_s": times[slowest],
            "step_time_median_s": statistics.median(times),
            # by rank, a mapping: trackers (TensorBoard, MLflow) flatten it into one series each
            "peak_mem_mb_per_rank": {str(r): round(t[1].item(), 1) for r, t in enumerate(every)}}
