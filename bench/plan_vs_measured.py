"""Planner predictions vs measured peak memory (live tensor bytes per rank, see meshformer/planner/measure.py).

CPU/gloo: every layout of plan_validation.LAYOUTS, one launch per world size; prints one row per
layout (worst rank) and the largest error. For a GPU, see bench/plan_vs_measured_gpu.py.

    python bench/plan_vs_measured.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import json

from parallel_common import spawn
from plan_validation import LAYOUTS, TOLERANCE, compare, measure_layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=sorted(LAYOUTS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        layouts = LAYOUTS[world]
        per_rank = [measure_layouts(layouts)] if world == 1 else spawn(world, measure_layouts, layouts)
        rows += compare(world, layouts, per_rank)
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
