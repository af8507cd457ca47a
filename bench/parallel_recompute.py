"""Activation recomputation: peak memory and step time for none / selective / full (and every 2nd block).

Each mode runs in a fresh process (peak RSS, VmHWM, cannot be reset for freed heap pages otherwise);
the peak is measured over forward + backward above the resident set before the first step, and the step
time is the fastest of a few steps over rounds that alternate the modes, so machine noise hits all alike.
Ratios are against `none` in the same run.

    python bench/parallel_recompute.py [--seq 1024] [--batch 4] [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from parallel_common import ROOT, batches, bench_config, build_cpu_plan
from tables import add_table_arguments, write_row

MODES = ("none", "selective", "every_k", "full")


def rss_peak_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_mode(mode: str, seq: int, batch: int, steps: int) -> dict[str, float]:

    torch.set_num_threads(2)
    cfg = bench_config({"recompute": mode, "recompute_every": 2}, d_model=256, n_layers=4, seq=seq, batch=batch)
    plan = build_cpu_plan(cfg)
    data = batches(cfg, 1)[0]
    tokens = plan.global_token_count([data])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    base = rss_peak_mib()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        plan.forward_backward(data, tokens)
        times.append(time.perf_counter() - start)
        for p in plan.model.parameters():
            p.grad = None
    return {"peak_delta_MiB": rss_peak_mib() - base, "step_s": min(times)}


SUMMARY = ["`bench/parallel_recompute.py`", "peak activation memory: none / selective / every 2nd / full"]


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: each mode's peak over none's, in MODES order."""
    by_mode = {r["recompute"]: r for r in records}
    return [*SUMMARY, " / ".join(f"{by_mode[mode]['peak_ratio']:.2f}" for mode in MODES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    add_table_arguments(parser)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args.seq, args.batch, args.steps)))
        return
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--mode", mode, "--seq", str(args.seq), "--batch",
                                  str(args.batch), "--steps", str(args.steps)], cwd=ROOT, capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            best = results.setdefault(mode, r)
            best["step_s"] = min(best["step_s"], r["step_s"])
            best["peak_delta_MiB"] = min(best["peak_delta_MiB"], r["peak_delta_MiB"])
    base = results["none"]
    records = []
    for mode, r in results.items():
        records.append({"recompute": mode, "peak_delta_MiB": round(r["peak_delta_MiB"], 1),
                        "peak_ratio": round(r["peak_delta_MiB"] / base["peak_delta_MiB"], 3),
                        "step_s": round(r["step_s"], 3), "time_ratio": round(r["step_s"] / base["step_s"], 3)})
        print(json.dumps(records[-1]))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
