"""Muon's optimizer step under FSDP and TP on gloo ranks (issue 37, item 6a): its time over fused AdamW's, and the
owner scheme (each matrix orthogonalised by one rank, `meshformer/optim/muon.py`) over every rank orthogonalising
every matrix it holds a piece of. Ratios from one run; one JSON line per world and layout.

    PYTHONPATH=$PWD python bench/muon_distributed.py --worlds 1 2 4 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from parallel_common import batches, bench_config, build_cpu_plan, spawn
from tables import add_table_arguments, write_row, write_table

N_LAYERS, BATCH = 4, 8


def step_ms(optimizer: torch.optim.Optimizer, rounds: int) -> float:
    optimizer.step()  # creates the state
    times = []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(layout: str, rounds: int, d_model: int) -> dict[str, Any]:
    from meshformer.optim import build_optimizer, muon

    world = dist.get_world_size() if dist.is_initialized() else 1
    parallel = {"dp_shard": world} if layout == "fsdp" else {"tp": world, "dp_shard": 1}
    cfg = bench_config(parallel if world > 1 else {}, d_model=d_model, n_layers=N_LAYERS, batch=BATCH)
    plan = build_cpu_plan(cfg)
    dp = plan.dp_size
    batch = {k: v.chunk(dp)[plan.dp_rank] for k, v in batches(bench_config({}, batch=BATCH), 1)[0].items()}
    start = time.perf_counter()
    plan.forward_backward(batch, plan.global_token_count([batch]))  # gradients to step with
    forward_backward_ms = 1e3 * (time.perf_counter() - start)
    out: dict[str, Any] = {"world": world, "layout": layout, "forward_backward_ms": forward_backward_ms}
    for name in ("adamw", "muon", "muon_every_rank"):
        cfg.optim.name = "adamw" if name == "adamw" else "muon"
        cfg.optim.adamw.implementation = "fused"
        optimizer, _ = build_optimizer(plan.model_parts, cfg.optim)
        owners = muon._owners
        if name == "muon_every_rank":  # the simple scheme: every rank orthogonalises every matrix it shares
            muon._owners = lambda params: [True] * len(params)  # type: ignore[assignment]
        try:
            out[f"{name}_ms"] = step_ms(optimizer, rounds)
        finally:
            muon._owners = owners  # type: ignore[assignment]
    out["muon_over_adamw"] = out["muon_ms"] / out["adamw_ms"]
    out["owners_over_every_rank"] = out["muon_ms"] / out["muon_every_rank_ms"]
    return out


SUMMARY = ["`bench/muon_distributed.py`", "Muon's step under FSDP / TP on 1, 2, 4 gloo ranks: over fused AdamW, and "
           "owner-per-matrix over every rank orthogonalising every matrix"]
STEP_TIME = "muon-04-step-time.json"  # the table of the Muon page
SUMMARY_TABLE = "parallel-01-cpu.json"  # this script's row of the parallel page's summary


def table_rows(records: list[dict]) -> list[list[str]]:
    """The Muon page's rows: owner-per-matrix over every-rank step time, per world size and layout."""
    return [[f"{r['world']}, {r['layout'].upper()}", f"{r['owners_over_every_rank']:.2f}"] for r in records
            if r["world"] > 1]


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: the same ratios in one cell, and the one-process ratio (the same work both ways:
    it shows the noise)."""
    ranks = ", ".join(f"{r['owners_over_every_rank']:.2f} ({r['layout'].upper()} {r['world']})" for r in records
                      if r["world"] > 1)
    single = [r["owners_over_every_rank"] for r in records if r["world"] == 1]
    noise = f"; one process, the same work both ways: {single[0]:.2f}" if single else ""
    return [*SUMMARY, f"owners / every rank: {ranks}{noise}"]


def write_tables(folder: Path, machine: str, records: list[dict]) -> None:
    single = [r["owners_over_every_rank"] for r in records if r["world"] == 1]
    worlds = sorted({r["world"] for r in records})
    noise = (f"The one-process row, where both schemes do the same work, read {single[0]:.2f}: the spread of these "
             "ratios from run to run. " if single else "")
    write_table(folder / STEP_TIME, machine=machine, page="muon", title="Optimizer-step time",
                command=f"python bench/muon_distributed.py --worlds {' '.join(str(w) for w in worlds)}",
                setup="On gloo ranks (d 256, 4 layers), each matrix orthogonalised by one owner rank against every "
                      "rank orthogonalising every matrix it holds a piece of:",
                notes=noise + "The work itself is 1/G of the matrices per rank (G: the ranks sharing them), which the "
                              "parity harness checks by counting (`ns_matrices`).",
                columns=["ranks, layout", "owners / every rank"], align=["l", "r"], rows=table_rows(records))
    write_row(folder / SUMMARY_TABLE, machine=machine, row=table_row(records))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    add_table_arguments(parser, folder=True)
    args = parser.parse_args()
    records = []
    for world in args.worlds:
        for layout in ("fsdp", "tp") if world > 1 else ("single",):
            if world == 1:
                torch.set_num_threads(1)
                record = measure(layout, args.rounds, args.d_model)
            else:
                record = spawn(world, measure, layout, args.rounds, args.d_model, threads=1)[0]
            records.append(record)
            print(json.dumps({"bench": "muon_distributed", **record}), flush=True)
    if args.table:
        write_tables(args.table, args.machine, records)


if __name__ == "__main__":
    main()
