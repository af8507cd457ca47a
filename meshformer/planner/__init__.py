"""The memory planner: per-rank memory of a training step for any layout and world size, without a GPU.

    dims, ranks = estimate(cfg, world_size=512)   # one RankMemory per distinct pipeline rank
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when used (torch), so that `meshformer plan --help` starts without them
    from meshformer.config import Config
    from meshformer.parallel_dims import ParallelDims
    from meshformer.planner.memory import RankMemory


def estimate(cfg: Config, world_size: int) -> tuple[ParallelDims, list[RankMemory]]:
    """Build and parallelise the model on meta under a fake `world_size`-rank group; memory per pipeline rank."""
    from meshformer.planner.memory import rank_memory
    from meshformer.planner.shard import fake_world, rank_shares

    with fake_world(world_size):
        dims, shares = rank_shares(cfg, world_size)
    return dims, [rank_memory(cfg, dims, share) for share in shares]


__all__ = ["estimate"]
