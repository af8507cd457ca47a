"""Progress (#24): a bar only on a terminal; a log gets a plain line per interval, not carriage-return clutter."""

from __future__ import annotations

import io

from meshformer import progress as progress_module
from meshformer.progress import Progress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_lines_per_interval_and_no_bar(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", log)
    bar = Progress(3, "merging", "task", interval_s=0.0)  # every update is an interval here
    for _ in range(3):
        bar.update()
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and [line.split(" (")[0] for line in lines] == [
        "merging: 1/3 tasks", "merging: 2/3 tasks", "merging: 3/3 tasks", "merging: 3/3 tasks"]


def test_a_short_task_leaves_a_log_alone(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(progress_module.sys, "stderr", log)
    assert list(progress(range(5), total=5, desc="reading")) == list(range(5))  # well within the interval
    assert log.getvalue() == ""


def test_a_terminal_gets_a_bar_that_stays(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", screen)
    assert list(progress(range(4), total=4, desc="converting", unit="tensor")) == list(range(4))
    assert "\r" in screen.getvalue() and "4/4" in screen.getvalue().split("\r")[-1]


def test_disabled_is_silent_on_a_terminal_too(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(progress_module.sys, "stderr", screen)
    bar = Progress(2, "x", "task", enabled=False, interval_s=0.0)
    bar.update()
    bar.close()
    assert screen.getvalue() == ""
