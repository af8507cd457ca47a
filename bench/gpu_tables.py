"""The benchmark pages' tables of a GPU run, built from the JSON lines its shell script collected ($OUT/results.jsonl,
see bench/gpu_common.sh): the one-GPU sweep (bench/gpu_sweep.sh) and the MoE layer (bench/gpu_moe.sh). The scripts
call it at their end, so the tables come back in $OUT with the run.

    python bench/gpu_tables.py sweep --results $OUT/results.jsonl --table $OUT/gpu-sweep.json [--machine TEXT]
    python bench/gpu_tables.py moe --results $OUT/results.jsonl --table $OUT/moe-02-layer-gpu.json
    python bench/gpu_tables.py machine --results $OUT/results.jsonl    # the machine, in words (the run's first line)
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from tables import add_table_arguments, write_table

MOE_SHAPES = {"mixtral-reduced": "Mixtral-like", "qwen3-moe": "Qwen3-MoE-like"}


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith('{"bench"')]


def machine_of(records: list[dict]) -> str:
    """"one <GPU> (torch <version>)" from the environment line gpu_common.sh writes first."""
    env = next((r for r in records if r["bench"] == "environment"), None)
    if env is None:
        return ""
    return f"one {env['gpu']} (torch {env['torch']})" if env.get("cuda") else f"a CPU dry run (torch {env['torch']})"


def signed_percent(fraction: float) -> str:
    return f"{100 * fraction:+.1f}%".replace("-", "−")


def sweep_rows(records: list[dict]) -> list[list[str]]:
    """gpu_sweep.sh's items, a row each: the GEMM ceiling, every shape's variants (tokens/s and ratio to the
    reference where one ran, else MFU), FP8 against bf16 (speed and loss), and where the profiled step spends GPU
    time."""
    rows = []
    for r in (r for r in records if r["bench"] == "gemm_ceiling"):
        fp8 = f", FP8 {r['fp8_tflops']:,.0f}" if r.get("fp8_tflops") else ""
        rows.append([f"{r['n']}³ GEMM (`bench/gemm_ceiling.py`)", f"bf16 {r['bf16_tflops']:,.0f} TFLOP/s{fp8}"])
    by_shape: dict[str, list[dict]] = defaultdict(list)
    for r in (r for r in records if r["bench"] == "speed_sweep"):
        by_shape[r["shape"]].append(r)
    for shape, runs in by_shape.items():
        reference = next((r for r in runs if r["variant"] == "reference"), None)
        cells = []
        for r in (r for r in runs if r["variant"] != "reference"):
            if "error" in r:
                cells.append(f"{r['variant']} failed")
            elif reference is not None:
                cells.append(f"{r['variant']} {r['tokens_per_s']:,.0f} ({r['ratio_vs_reference']:.3f}×)")
            else:
                cells.append(f"{r['variant']} {r['mfu']:.1%} MFU" if r.get("mfu") else
                             f"{r['variant']} {r['tokens_per_s']:,.0f} tok/s")
        label = (f"{shape} shape vs the nanoGPT-style reference, {reference['compile']} compiled "
                 f"({reference['tokens_per_s']:,.0f} tok/s)" if reference is not None else f"{shape} shape")
        rows.append([label, ", ".join(cells)])
    fp8 = [r for r in records if r["bench"] == "fp8_layers"]
    baseline = next((r for r in fp8 if r["recipe"] == "off"), None)
    if baseline is not None and len(fp8) > 1:
        cells = [f"{r['recipe']} {r['tokens_per_s'] / baseline['tokens_per_s']:.2f}× bf16 tokens/s, loss "
                 f"{signed_percent(r['loss_last10'] / baseline['loss_last10'] - 1)}" for r in fp8 if r is not baseline]
        rows.append([f"FP8 at the {baseline['shape']} shape, {baseline['steps']} steps (`bench/fp8_layers.py`), "
                     "against bf16", "; ".join(cells)])
    for r in (r for r in records if r["bench"] == "profile_step"):
        families = r.get("gpu_ms_per_step") or r.get("self_cpu_ms_per_step") or {}
        top = sorted(families.items(), key=lambda item: item[1], reverse=True)[:5]
        busy = f", GPU busy {r['gpu_busy_ms_per_step']:.1f}" if "gpu_busy_ms_per_step" in r else ""
        rows.append([f"where the {r['shape']} step ({r['side']}, {r['variant']}) spends its time "
                     "(`bench/profile_step.py`), ms per step",
                     ", ".join(f"{name} {ms:.1f}" for name, ms in top) + f"; step {r['step_ms']:.1f}{busy}"])
    return rows


def moe_rows(records: list[dict]) -> list[list[str]]:
    """One row per (shape, routing): the grouped_mm layer against the dense FFN, eager (the compute function's ratio
    in brackets) and compiled, each side timed step by step (queue 1)."""
    runs: dict[tuple[str, str], dict[str, dict]] = defaultdict(dict)
    for r in (r for r in records if r["bench"] == "moe_layer" and r["queue"] == 1):
        runs[(r["shape"], r["routing"])]["compiled" if r["compiled"] else "eager"] = r
    rows = []
    for (shape, routing), sides in runs.items():
        cells = []
        for side in ("eager", "compiled"):
            r = sides.get(side)
            backend = r and (r["backends"].get("grouped_mm") or r["backends"].get(r.get("best_backend", "")))
            if not backend:
                cells += ["", ""]
                continue
            speed = f"{backend['tokens_per_s']:,.0f} / {r['dense_tokens_per_s']:,.0f}"
            compute = f" ({backend['compute_ratio']:.2f})" if side == "eager" else ""
            cells += [speed, f"{backend['ratio']:.2f}{compute}"]
        rows.append([MOE_SHAPES.get(shape, shape), routing, *cells])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["sweep", "moe", "machine"])
    parser.add_argument("--results", type=Path, required=True, help="the run's results.jsonl")
    add_table_arguments(parser)
    args = parser.parse_args()
    records = read_results(args.results)
    machine = args.machine or machine_of(records)
    if args.kind == "machine":
        print(machine)
        return
    if args.table is None:
        raise SystemExit("give --table PATH: where to write the table")
    if args.kind == "sweep":
        peak = next((r["peak_flops"] for r in records if r.get("peak_flops")), None)
        mfu = f"; MFU against the {peak / 1e12:,.0f} TFLOP/s bf16 peak the trainer assumes" if peak else ""
        title = machine.split(" (")[0]
        write_table(args.table, machine=machine, page="gpu", title=title[0].upper() + title[1:],
                    command="bash bench/gpu_sweep.sh",
                    setup=f"bf16, synchronised tokens/s, FLOPs/token = 6N + 12·L·d·T{mfu}.",
                    columns=["measurement", "result"], rows=sweep_rows(records))
    else:
        rounds = next((r["rounds"] for r in records if r["bench"] == "moe_layer"), 0)
        write_table(args.table, machine=machine, page="moe", title="MoE layer speed on a GPU",
                    command="OUT=/tmp/moe-out bash bench/gpu_moe.sh",
                    setup=f"The same measurement, `grouped_mm` backend, synchronised, {rounds} rounds; eager, and with "
                          "both sides under `torch.compile` as `train.compile` runs them (`--compile`). Mixtral-like: "
                          "d 4096, 8 × 7168 top-2, 8192 tokens; Qwen3-MoE-like: d 2048, 128 × 768 top-8, 8192 tokens.",
                    columns=["shape", "routing", "eager: MoE / dense tok/s", "eager ratio (compute alone)",
                             "compiled: MoE / dense tok/s", "compiled ratio"],
                    align=["l", "l", "r", "r", "r", "r"], rows=moe_rows(records))


if __name__ == "__main__":
    main()
