"""Per-rank step time and data-wait time, gathered at logging steps to spot stragglers.

Every rank contributes its mean step time and mean data-wait time over the logging window (one tiny
all-gather per logging interval, where the trainer synchronises anyway). In lockstep data parallelism the
collectives make every rank's step time converge on the slowest rank's, so the step-time spread shows
ranks that drift apart between synchronisation points, while the data-wait spread names input-pipeline
stragglers directly (slow disk or network storage, an overloaded loader).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_timings(step_time_s: float, data_wait_s: float, device: torch.device) -> torch.Tensor:
    """[world, 2] tensor of (step time, data wait) per rank; [1, 2] outside a process group."""
    mine = torch.tensor([step_time_s, data_wait_s], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine.unsqueeze(0)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)  # the list form: gloo lacks all_gather_into_tensor on some builds
    return torch.stack(everyone)


def straggler_scalars(timings: torch.Tensor) -> dict[str, float]:
    """TensorBoard scalars from rank_timings(): data wait, step-time spread and the slowest ranks."""
    step, wait = timings[:, 0].cpu(), timings[:, 1].cpu()
    values = {"perf/data_wait_s": float(wait.mean())}
    if len(timings) > 1:
        values |= {
            "stragglers/step_time_min_s": float(step.min()),
            "stragglers/step_time_max_s": float(step.max()),
            "stragglers/step_time_spread_pct": float(100 * (step.max() - step.min()) / step.mean().clamp_min(1e-12)),
            "stragglers/step_time_max_rank": float(step.argmax()),
            "stragglers/data_wait_max_s": float(wait.max()),
            "stragglers/data_wait_max_rank": float(wait.argmax()),
        }
    return values
