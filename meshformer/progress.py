"""Progress of long commands (data prepare, conversions): a bar on a terminal, and in a log (stderr piped to a
file) a plain line per interval instead of a bar's carriage-return clutter."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
LOG_INTERVAL_S = 30.0  # a log gets a line this often (and one at the end once it got any)


class Progress:
    """`update()` per finished item; `close()` at the end. Disabled: silent."""

    def __init__(self, total: int | None, desc: str, unit: str, *, enabled: bool = True,
                 interval_s: float = LOG_INTERVAL_S) -> None:
        self.total, self.desc, self.unit, self.interval_s = total, desc, unit, interval_s
        self.done, self.lines = 0, 0
        self.start = self.last = time.monotonic()
        self.bar: Any = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)  # stays on screen when done

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.last >= self.interval_s:
            self._line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.lines:  # a short task leaves a log alone; a long one says that it finished
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        self.lines += 1
        of = f"/{self.total}" if self.total is not None else ""
        print(f"{self.desc}: {self.done}{of} {self.unit}s ({self.last - self.start:.0f}s)", file=sys.stderr,
              flush=True)


def progress(items: Iterable[T], *, total: int | None = None, desc: str = "", enabled: bool = True,
             unit: str = "item") -> Iterator[T]:
    """`items`, reporting progress as they are consumed."""
    bar = Progress(total, desc, unit, enabled=enabled)
    for item in items:
        yield item
        bar.update()
    bar.close()
