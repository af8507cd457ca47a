"""Pipeline bubble: measured idle fraction per schedule against the textbook (p-1)/(m+p-1).

Each rank times its compute (stage forward, backward, weight-gradient chunks and the loss) inside one
pipeline step; idle = 1 - compute / step wall time, averaged over ranks, after a warm-up step (which also
runs the schedule's shape inference). p = 2 pipeline ranks on this 2-core machine (one core each).
Interleaved schedules run v = 2 stages per rank; their textbook bubble is (p-1)/(v*m+p-1).

    python bench/parallel_bubble.py [--microbatches 4 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from parallel_common import batches, bench_config, build_cpu_plan, spawn
from tables import add_table_arguments, write_row

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "interleaved_zb": 2, "zbv": 2}


def _timed(cls, name: str, clock: list[float]) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def measure(schedule: str, microbatches: int, steps: int) -> dict[str, float]:
    from torch.distributed.pipelining import schedules, stage


    clock = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        _timed(stage._PipelineStageBase, name, clock)
    _timed(schedules._PipelineSchedule, "_compute_loss", clock)
    cfg = bench_config({"pp": 2, "dp_shard": 1, "pp_schedule": schedule, "pp_microbatches": microbatches,
                        "pp_stages_per_rank": SCHEDULES[schedule]}, d_model=256, n_layers=8, seq=128, batch=16)
    plan = build_cpu_plan(cfg)
    data = batches(cfg, 1)[0]
    tokens = plan.global_token_count([data])
    plan.forward_backward(data, tokens)  # warm-up: shape inference, allocator
    idle = []
    for _ in range(steps):
        clock[0] = 0.0
        torch.distributed.barrier()
        start = time.perf_counter()
        plan.forward_backward(data, tokens)
        wall = time.perf_counter() - start
        idle.append(1 - clock[0] / wall)
    return {"idle": min(idle), "step_s": wall}


SUMMARY = ["`bench/parallel_bubble.py`", "measured pipeline idle fraction vs (p−1)/(m+p−1) per schedule"]
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B", "interleaved_zb": "interleaved ZB",
         "zbv": "ZBV"}


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: at the most micro-batches measured, each schedule's idle fraction (textbook)."""
    m = max(r["m"] for r in records)
    cells = [f"{NAMES.get(r['schedule'], r['schedule'])} {r['measured_idle']:.2f} ({r['textbook_(p-1)/(v*m+p-1)']:.2f})"
             for r in records if r["m"] == m]
    return [*SUMMARY, f"p={records[0]['p']}, m={m}, measured (textbook): {', '.join(cells)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=3)
    add_table_arguments(parser)
    args = parser.parse_args()
    p = 2
    records = []
    for m in args.microbatches:
        for schedule, v in SCHEDULES.items():
            ranks = spawn(p, measure, schedule, m, args.steps, threads=1)
            idle = sum(r["idle"] for r in ranks) / p
            record = {"schedule": schedule, "p": p, "m": m, "v": v, "measured_idle": round(idle, 3),
                              "textbook_(p-1)/(m+p-1)": round((p - 1) / (m + p - 1), 3),
                              "textbook_(p-1)/(v*m+p-1)": round((p - 1) / (v * m + p - 1), 3),
                              "step_s": round(max(r["step_s"] for r in ranks), 3)}
            records.append(record)
            print(json.dumps(record))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
