"""Planner predictions vs measured peak memory (live tensor bytes per rank, see meshformer/planner/measure.py).

CPU/gloo: every layout of plan_validation.LAYOUTS, one launch per world size; prints one row per
layout (worst rank) and the largest error. For a GPU, see bench/plan_vs_measured_gpu.py.

    python bench/plan_vs_measured.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from parallel_common import spawn
from plan_validation import LAYOUTS, TOLERANCE, compare, measure_layouts
from tables import add_table_arguments, write_table


def layout_name(layout: dict) -> str:
    if layout == {"single": "process"}:
        return "single process"
    parts = [f"{key}={value}" for key, value in layout.items() if key != "model"]
    return ", ".join(["MoE"] * ("model" in layout) + parts)


def signed_percent(fraction: float) -> str:
    return f"{100 * fraction:+.1f}%".replace("-", "−")


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One row per layout: ranks, the layout, predicted and measured MiB (worst rank) and the planner's error."""
    return [[str(r["world"]), layout_name(r["layout"]), f"{r['predicted'] / 2**20:.2f}", f"{r['measured'] / 2**20:.2f}",
             signed_percent(r["error"])] for r in rows]


def write(path: Path, machine: str, rows: list[dict]) -> dict:
    worst = max(rows, key=lambda r: abs(r["error"]))
    moe = [r for r in rows if r["predicted_default"] != r["predicted"]]
    notes = f"Largest error {signed_percent(worst['error'])} ({layout_name(worst['layout'])}, {worst['world']} ranks). "
    if moe:
        notes += ("The MoE rows are predicted at the routing the step measured (the worst rank's experts received up "
                  f"to {max(r['moe_imbalance'] for r in moe):.3f}× the balanced rows), so they test the accounting, "
                  "not the router; at the default `--moe-imbalance` the expert-parallel layouts are predicted "
                  + ", ".join(f"{signed_percent(r['predicted_default'] / r['measured'] - 1)}" for r in moe)
                  + " against measured: the margin the default buys.")
    return write_table(
        path, machine=machine, page="parallel", title="Memory planner: predicted vs measured",
        command="python bench/plan_vs_measured.py",
        setup="A 4-layer Llama-style decoder (d 128, GQA, SwiGLU, untied, seq 128, batch 4); \"measured\" is each "
              "rank's peak of live tensor bytes over one training step (a dispatch mode that also sees FSDP2's "
              "storage resizes), worst rank. Attention runs the blockwise CPU kernel, whose stored probabilities the "
              f"planner counts. `tests/unit/planner/test_plan.py` checks the bound ({100 * TOLERANCE:.0f}%).",
        notes=notes, columns=["ranks", "layout", "predicted MiB", "measured MiB", "error"],
        align=["r", "l", "r", "r", "r"], rows=table_rows(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=sorted(LAYOUTS))
    parser.add_argument("--json", action="store_true")
    add_table_arguments(parser)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        layouts = LAYOUTS[world]
        per_rank = [measure_layouts(layouts)] if world == 1 else spawn(world, measure_layouts, layouts)
        rows += compare(world, layouts, per_rank)
    if args.table:
        write(args.table, args.machine, rows)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'ranks':>5}  {'layout':<62} {'predicted MiB':>13} {'measured MiB':>12} {'error':>7}")
    for r in rows:
        layout = ", ".join(f"{k}={v}" for k, v in r["layout"].items())
        print(f"{r['world']:>5}  {layout:<62} {r['predicted'] / 2**20:>13.2f} {r['measured'] / 2**20:>12.2f} "
              f"{100 * r['error']:>+6.1f}%")
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest error {100 * worst:.1f}% over {len(rows)} layouts (goal: within {100 * TOLERANCE:.0f}%)")


if __name__ == "__main__":
    main()
