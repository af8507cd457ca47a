"""Progress bars for conversions (tqdm on stderr; silent when disabled or when stderr is not a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool | None = None,
             unit: str = "tensor") -> Iterator[T]:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)


def chunks(keys: list[str], size: int) -> list[list[str]]:
    return [keys[i:i + size] for i in range(0, len(keys), size)]
