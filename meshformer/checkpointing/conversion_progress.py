"""Progress of conversions: `progress` (meshformer/progress.py: a bar on a terminal, a line per interval in a log)."""

from __future__ import annotations

from meshformer.progress import progress

__all__ = ["chunks", "progress"]


def chunks(keys: list[str], size: int) -> list[list[str]]:
    return [keys[i:i + size] for i in range(0, len(keys), size)]
