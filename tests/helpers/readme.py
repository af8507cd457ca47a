"""The README's commands, as a user would type them (tests check that they work where the README says they do)."""

from __future__ import annotations

import re
import shlex

from helpers.common import ROOT


def readme_commands() -> list[list[str]]:
    """Every `meshformer ...` / `torchrun ... -m meshformer.train ...` line of the README's bash blocks, split
    into words (comments and line continuations dropped; `a && b` gives two commands)."""
    text = (ROOT / "README.md").read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    commands = []
    for line in lines:
        for part in line.split("&&"):
            words = shlex.split(part.split("#")[0].rstrip(" \\"))
            if words[:1] == ["meshformer"] or "meshformer.train" in words:
                commands.append(words)
    return commands
