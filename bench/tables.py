"""How a benchmark script writes its table of the documentation's benchmark pages (docs/benchmarks/data/*.json,
rendered by bench/render_tables.py): each script takes `--table PATH --machine TEXT` and, when given them, writes
its measured rows with today's date.

    write_table(args.table, machine=args.machine, page="moe", title=..., command=..., columns=[...], rows=[...])
    write_row(args.table, machine=args.machine, row=[...])   # one script's row of a summary table ("measured" column)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any


def add_table_arguments(parser: argparse.ArgumentParser, folder: bool = False) -> None:
    """`folder`: the script writes several tables, under their own names, into the folder --table names."""
    where = ("write the benchmark pages' table JSON files into this folder (docs/benchmarks/data)" if folder else
             "write the benchmark page's table JSON here (docs/benchmarks/data/<page>-<order>-<name>.json)")
    parser.add_argument("--table", type=Path, help=where)
    parser.add_argument("--machine", default="", help="the machine the figures were measured on, in words")


def today() -> str:
    return datetime.date.today().isoformat()


def _save(path: Path, table: dict[str, Any]) -> dict[str, Any]:
    if not table.get("machine"):
        raise SystemExit(f"{path}: give --machine (the machine the figures were measured on, in words)")
    width = len(table["columns"])
    for row in table["rows"]:
        if len(row) != width:
            raise ValueError(f"{path}: row {row} has {len(row)} cells, the header {width}")
    path.write_text(json.dumps(table, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}; render the pages with: python bench/render_tables.py", file=sys.stderr)
    return table


def write_table(path: Path, *, machine: str, page: str, title: str, command: str, columns: list[str],
                rows: list[list[Any]], **optional: Any) -> dict[str, Any]:
    """A whole table measured by one run (optional keys: setup, notes, align, image, image_alt)."""
    table = {"page": page, "title": title, "machine": machine, "date": today(), "command": command, **optional,
             "columns": columns, "rows": [[str(cell) for cell in row] for row in rows]}
    return _save(path, table)


def write_row(path: Path, *, machine: str, row: list[Any]) -> dict[str, Any]:
    """Replace this script's row (matched by its first cell) of a summary table whose last column is "measured",
    dated today; the other scripts' rows keep theirs."""
    table = json.loads(path.read_text())
    if table["columns"][-1] != "measured":
        raise ValueError(f"{path}: not a summary table (its last column is not 'measured')")
    cells = [str(cell) for cell in row] + [today()]
    rows = table["rows"]
    at = next((i for i, r in enumerate(rows) if r[0] == cells[0]), None)
    if at is None:
        rows.append(cells)
    else:
        rows[at] = cells
    if machine != table["machine"]:
        raise SystemExit(f"{path}: its rows were measured on {table['machine']!r}; give that --machine, or start "
                         "a table of its own for another machine")
    return _save(path, table)
