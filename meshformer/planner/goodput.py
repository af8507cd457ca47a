"""`meshformer plan CONFIG --world W --failures`: the share of wall time that trains, under hardware failures, for
checkpoint-restart against replica healing (docs/fault-tolerance.md, "Goodput at scale").

First-order model (Young 1974; Daly 2006), failures a Poisson process of rate world x the per-GPU rate:
- checkpoint-restart saves every tau = sqrt(2 x save x MTBF) seconds (Young/Daly's optimum), losing save/tau of the
  time to saving, and on each failure the restart, the checkpoint's load and on average tau/2 of retrained work:
  ratio = 1 - save/tau - (restart + load + tau/2) / MTBF.
- replica healing loses, per failure, the survivors' pause (every group) and the failed group's absence until it
  rejoins (1/groups of the job): ratio = 1 - (pause + rejoin / groups) / MTBF. Checkpoints, still written for
  whole-job stops, are left out of both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshformer.launcher.torchrun import CHECKPOINT_WRITE_BYTES_PER_S, checkpoint_write_s

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4): 419 unexpected interruptions in a
# 54-day snapshot of pre-training on 16,384 H100 GPUs
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
FAILURES_PER_GPU_S = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86400 * LLAMA3_GPUS)

# Measured by bench/fault_tolerance.py (docs/benchmarks/fault-tolerance.md: tiny-gpt, 2 groups of 2 ranks, gloo, CPU,
# the cores otherwise idle):
HEAL_PAUSE_S = 2.0  # kill -9 of a rank to the survivors' next step
HEAL_REJOIN_S = 4.5  # kill -9 to the killed group back in the quorum
# checkpoint-restart: kill -9 to the restarted job's first step (start-up, rendezvous, load of a tiny checkpoint);
# the steps trained again are the model's tau/2
RESTART_S = 13.1

SCALES = (1024, 16384)  # the worlds `plan --failures` always shows
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Goodput:
    world: int
    mtbf_s: float  # mean time between failures of the whole job
    save_s: float  # checkpoint write (and, at the same rate, load)
    interval_s: float  # Young/Daly checkpoint interval
    checkpoint_restart: float  # share of wall time that trains
    replica_healing: float
    groups: int


def mtbf_s(world: int, failures_per_gpu_s: float = FAILURES_PER_GPU_S) -> float:
    return 1 / (failures_per_gpu_s * world)


def young_daly_interval_s(save_s: float, mtbf: float) -> float:
    """The checkpoint interval that minimises saving plus lost work, to first order: sqrt(2 x save x MTBF)."""
    return math.sqrt(2 * save_s * mtbf)


def checkpoint_restart_ratio(save_s: float, load_s: float, restart_s: float, mtbf: float) -> float:
    interval = young_daly_interval_s(save_s, mtbf)
    return max(0.0, 1 - save_s / interval - (restart_s + load_s + interval / 2) / mtbf)


def replica_healing_ratio(pause_s: float, rejoin_s: float, groups: int, mtbf: float) -> float:
    return max(0.0, 1 - (pause_s + rejoin_s / groups) / mtbf)


def goodput(total_params: int, world: int, *, group_gpus: int = GPUS_PER_NODE, restart_s: float = RESTART_S,
            pause_s: float = HEAL_PAUSE_S, rejoin_s: float = HEAL_REJOIN_S) -> Goodput:
    """Both paths at `world` GPUs for a model of `total_params`; the checkpoint is written (and read) by every
    node at the launcher's per-node rate."""
    mtbf = mtbf_s(world)
    save = checkpoint_write_s(total_params, max(1, world // GPUS_PER_NODE))
    groups = max(1, world // group_gpus)
    return Goodput(world, mtbf, save, young_daly_interval_s(save, mtbf),
                   checkpoint_restart_ratio(save, save, restart_s, mtbf),
                   replica_healing_ratio(pause_s, rejoin_s, groups, mtbf), groups)


def print_goodput(name: str, total_params: int, worlds: list[int], *, group_gpus: int, restart_s: float) -> None:
    rows = [goodput(total_params, world, group_gpus=group_gpus, restart_s=restart_s) for world in worlds]
    print(f"{name} ({total_params / 1e9:.1f}B parameters): share of wall time that trains under failures")
    print(f"inputs: {FAILURES_PER_GPU_S * 86400 * 1e6:.1f} failures per million GPU-days (Llama 3: "
          f"{LLAMA3_INTERRUPTIONS} in {LLAMA3_DAYS} days on {LLAMA3_GPUS} GPUs); checkpoint 12 bytes/parameter "
          f"written and read at {CHECKPOINT_WRITE_BYTES_PER_S / 1e6:.0f} MB/s per node of {GPUS_PER_NODE} GPUs; "
          f"restart {restart_s:.1f} s; heal: survivors' pause {HEAL_PAUSE_S} s, rejoin {HEAL_REJOIN_S} s, groups of "
          f"{group_gpus} GPUs (measured: docs/benchmarks/fault-tolerance.md)")
    print("| GPUs | MTBF (h) | save (s) | Young/Daly interval (min) | checkpoint-restart | replica healing |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row.world:,} | {row.mtbf_s / 3600:.2f} | {row.save_s:.1f} | {row.interval_s / 60:.1f} | "
              f"{row.checkpoint_restart:.4f} | {row.replica_healing:.4f} |")
