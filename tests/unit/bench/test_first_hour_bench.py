"""bench/first_hour.py times commands the documentation shows, not commands of its own."""

import shlex
import sys

from helpers.common import ROOT
from helpers.readme import doc_commands

sys.path.insert(0, str(ROOT / "bench"))
import first_hour


def test_every_timed_command_is_shown_in_the_docs():
    shown = [words for words in doc_commands()]
    for _, command in first_hour.JOURNEY:
        assert shlex.split(command) in shown, f"{command!r} is not a command of the docs"


def test_the_table_adds_up_the_milestones():
    steps = [{"milestone": "a", "command": "x", "seconds": 10.0, "first_loss_s": None},
             {"milestone": "b", "command": "y", "seconds": 30.0, "first_loss_s": 4.0}]
    rows = first_hour.table_rows(steps)
    assert [row[3:] for row in rows] == [["", "10 s"], ["14 s", "40 s"]]
