"""The documentation's memory-planner tables (docs/benchmarks/planner-tables.md) are what `tools/plan_tables.py`
prints today.

Each table's first row is recomputed (the cheap ones: 8 ranks); a planner change that moves the figures must
regenerate the tables, or a reader copying a command gets other numbers than the page shows.
"""

from __future__ import annotations

import pytest
from helpers.common import ROOT, load_script


def _plan_tables():
    return load_script("tools/plan_tables.py")


PAGE = ROOT / "docs" / "benchmarks" / "planner-tables.md"


def _page_row(config: str, world: int) -> list[str]:
    """The page's table row for `config` at `world` ranks, without its CPU-seconds cell."""
    prefix = f"| {config} | {world} |"
    rows = [line for line in PAGE.read_text().splitlines() if line.startswith(prefix)]
    assert len(rows) == 1, f"expected one row starting {prefix!r}, found {len(rows)}"
    return [cell.strip() for cell in rows[0].strip("|").split("|")][:-1]


# gpt-oss-120b at 512 ranks: its smallest fitting layout must be one FSDP can shard (ep=2 splits 2880 rows unevenly)
@pytest.mark.parametrize(("config", "world"), [("llama-8b", 8), ("llama3.2-1b", 8), ("olmoe-1b-7b", 8),
                                               ("gpt-oss-120b", 512)])
def test_planner_table_row_matches_the_planner(config, world):
    assert _plan_tables().table_row(config, world, "h100-80gb") == _page_row(config, world)
