"""Throughput of each parallel layout on this machine, as a ratio to one process on the same global batch.

CAVEAT: this machine has 2 CPU cores, so the numbers measure the *overhead* each layout adds (communication
through gloo, pipeline bubbles, resharding), not scaling; on GPUs, with one device per rank, layouts scale.
Every process runs one thread (multi-threaded OpenMP collapses when the shared cores are oversubscribed),
so `per_core_ratio` = (tokens/s per busy core) / (the same for one process) is the efficiency of a layout:
1.0 means no overhead. 4 and 8 processes share the 2 cores.

    python bench/parallel_throughput.py [--steps 3] [--layouts single fsdp2 tp2 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from parallel_common import batches, bench_config, build_cpu_plan, spawn
from tables import add_table_arguments, write_row

LAYOUTS: dict[str, tuple[int, dict]] = {
    "single": (1, {}),
    "fsdp2": (2, {"dp_shard": 2}),
    "tp2": (2, {"tp": 2, "dp_shard": 1}),
    "pp2_1f1b": (2, {"pp": 2, "dp_shard": 1, "pp_microbatches": 4}),
    "pp2_zbv": (2, {"pp": 2, "dp_shard": 1, "pp_schedule": "zbv", "pp_microbatches": 4}),
    "cp2": (2, {"cp": 2, "dp_shard": 1}),
    "hsdp2x2": (4, {"dp_replicate": 2, "dp_shard": 2}),
    "tp2_fsdp2": (4, {"tp": 2, "dp_shard": 2}),
    "pp2_fsdp2": (4, {"pp": 2, "dp_shard": 2, "pp_microbatches": 4}),
    "pp2_tp2": (4, {"pp": 2, "tp": 2, "dp_shard": 1, "pp_microbatches": 4}),
    "cp2_fsdp2": (4, {"cp": 2, "dp_shard": 2}),
    "pp2_dp2_tp2": (8, {"pp": 2, "tp": 2, "dp_shard": 2, "pp_microbatches": 2}),
}
GLOBAL_BATCH, SEQ = 16, 128
CORES = os.cpu_count() or 1


def measure(parallel: dict, steps: int) -> dict[str, float]:
    from meshformer.config import OptimConfig, ScheduleConfig
    from meshformer.optim import AdamWConfig
    from meshformer.train.step import TrainStep

    world = torch.distributed.get_world_size()
    dp = world // (parallel.get("pp", 1) * parallel.get("tp", 1) * parallel.get("cp", 1))
    cfg = bench_config(parallel, d_model=256, n_layers=8, seq=SEQ, batch=GLOBAL_BATCH // dp)
    plan = build_cpu_plan(cfg)
    training = TrainStep(plan, OptimConfig(lr=1e-4, weight_decay=0.0, grad_clip=1.0,
                                           adamw=AdamWConfig(implementation="fused")),
                         ScheduleConfig(name="constant", warmup_steps=0), steps + 1, cfg.model.d_model)
    data = [{k: v.chunk(dp)[plan.dp_rank] for k, v in b.items()} for b in batches(bench_config(
        {}, d_model=256, n_layers=8, seq=SEQ, batch=GLOBAL_BATCH), steps + 1)]
    times = []
    for batch in data:
        torch.distributed.barrier()
        start = time.perf_counter()
        training.step([batch])
        times.append(time.perf_counter() - start)
    return {"step_s": min(times[1:])}  # the first step warms up (and infers pipeline shapes)


SUMMARY = ["`bench/parallel_throughput.py`", "tokens/s per busy core of each layout vs one process (overhead, not "
           "scaling: 2 cores)"]


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: the range of the layouts' per-core ratios, and each layout's."""
    layouts = [r for r in records if r["processes"] > 1]
    ratios = [r["per_core_ratio"] for r in layouts]
    each = ", ".join(f"{r['layout']} {r['per_core_ratio']:.2f}" for r in layouts)
    return [*SUMMARY, f"{min(ratios):.2f}–{max(ratios):.2f} ({each})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    add_table_arguments(parser)
    args = parser.parse_args()
    base = None
    records = []
    for name in args.layouts:
        world, parallel = LAYOUTS[name]
        step = max(r["step_s"] for r in spawn(world, measure, parallel, args.steps, threads=1))
        tokens_per_s = GLOBAL_BATCH * SEQ / step
        per_core = tokens_per_s / min(world, CORES)
        base = base or per_core
        record = {"layout": name, "processes": world, "tokens_per_s": round(tokens_per_s),
                          "per_core_ratio": round(per_core / base, 3),
                          "note": f"{CORES} shared CPU cores: overhead, not scaling"}
        records.append(record)
        print(json.dumps(record))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
