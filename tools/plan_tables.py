"""Markdown tables of `meshformer plan` for the large configs at 8 to 4096 ranks (docs/benchmarks/planner-tables.md).

    python tools/plan_tables.py [--gpu h100-80gb]
    python tools/plan_tables.py --configs mixtral-8x7b qwen3-30b-a3b olmoe-1b-7b --worlds 8 64 512   # MoE table
    python tools/plan_tables.py --page   # rewrite every table of the page below its marker

A marker `<!-- tools/plan_tables.py ARGS -->` on the page names the arguments of the table that follows it.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshformer.config import ConfigError, load_config  # noqa: E402
from meshformer.planner.activations import MOE_IMBALANCE  # noqa: E402
from meshformer.planner.cli import layout_name  # noqa: E402
from meshformer.planner.memory import usable_bytes  # noqa: E402
from meshformer.planner.search import plan_layout, search_layouts, with_layout  # noqa: E402

GiB = 2**30
PAGE = ROOT / "docs" / "benchmarks" / "planner-tables.md"
MARKER = re.compile(r"<!-- tools/plan_tables.py ?(.*?) -->")


def table_row(name: str, world: int, gpu: str, moe_imbalance: float = MOE_IMBALANCE) -> list[str]:
    """One row's cells but the CPU time: config, ranks, the configured layout, the smallest fitting one, its peak."""
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    budget = usable_bytes(gpu)
    p = cfg.parallel
    try:  # the configured pp x tp with FSDP over the rest (bf16 autocast where no data-parallel ranks)
        own = plan_layout(with_layout(cfg, world, p.pp, p.tp, p.recompute), world, moe_imbalance)
        configured = (f"{layout_name(own)} {own.recompute}: {own.peak / GiB:.1f}, "
                      f"{'yes' if own.peak <= budget else 'no'}")
    except ConfigError:
        configured = f"needs pp x tp = {p.pp * p.tp} ranks" if world < p.pp * p.tp else f"needs ep = {p.ep}"
    fitting = [lay for lay in search_layouts(cfg, world, gpu, moe_imbalance) if lay.peak <= budget]
    best = (f"{layout_name(fitting[0])} {fitting[0].recompute}", f"{fitting[0].peak / GiB:.1f}") \
        if fitting else ("none fits", "—")
    return [name, str(world), configured, *best]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", default="h100-80gb")
    parser.add_argument("--configs", nargs="+", default=["llama-8b", "llama-70b", "llama-405b", "gpt3-175b"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--moe-imbalance", type=float, default=MOE_IMBALANCE)
    parser.add_argument("--page", action="store_true", help=f"rewrite the tables of {PAGE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.page:
        write_page(parser)
        return
    for line in table_lines(args):
        print(line, flush=True)


def table_lines(args: argparse.Namespace) -> list[str]:
    lines = ["| config | ranks | configured layout: GiB/rank, fits? | smallest layout that fits | GiB/rank | CPU s |",
             "| --- | ---: | --- | --- | ---: | ---: |"]
    for name in args.configs:
        for world in args.worlds:
            start = time.process_time()
            cells = table_row(name, world, args.gpu, args.moe_imbalance)
            lines.append(f"| {' | '.join(cells)} | {time.process_time() - start:.0f} |")
    return lines


def write_page(parser: argparse.ArgumentParser) -> None:
    """Each marker's table recomputed with the marker's arguments; the rest of the page kept as it is."""
    lines, out = PAGE.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        marker = MARKER.fullmatch(lines[i])
        i += 1
        if marker is None:
            continue
        while i < len(lines) and not lines[i].startswith("|"):  # the text between the marker and its table
            out.append(lines[i])
            i += 1
        while i < len(lines) and lines[i].startswith("|"):  # the old table
            i += 1
        out.extend(table_lines(parser.parse_args(marker.group(1).split())))
    PAGE.write_text("\n".join(out) + "\n")
    print(f"wrote {PAGE}", file=sys.stderr)


if __name__ == "__main__":
    main()
