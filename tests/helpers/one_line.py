"""Running a command in-process as the bad-input tables do: what it writes to stderr, and the one line it must be."""

from __future__ import annotations

import pytest

from meshformer.cli import main


def run_main(argv: list[str], capsys) -> str:
    """Everything the command writes to stderr, including the line Python would print for SystemExit("...")."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    code = info.value.code
    assert code not in (0, None), f"exit status {code!r}"
    return capsys.readouterr().err + (f"{code}\n" if isinstance(code, str) else "")


def assert_one_line(err: str, words: list[str]) -> str:
    """`err` is one line `error: ...`, without a traceback, holding each of `words` (case-insensitive)."""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word.lower() in lines[0].lower(), (word, lines[0])
    return lines[0]
