"""The commands the README and the documentation pages show, as a user would type them (tests run them where the
pages say they work).

A page's `bash` blocks hold commands; a block preceded by a line `<!-- not run by the tests: REASON -->` is shown but
not run (a command that needs a cluster or a GPU), and says why on the page itself.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from helpers.common import ROOT

SKIP_MARKER = re.compile(r"<!-- not run by the tests: (.+?) -->")
# A code block preceded by this line is a file the reader writes: the tests write it where it says before the
# page's commands run (a relative path, in the folder the commands run in).
FILE_MARKER = re.compile(r"^<!-- file: (\S+) -->\n```[a-z]*\n(.*?)```", re.S | re.M)
# A python block preceded by this line is run by the tests as shown, after the page's commands, in their folder.
RUN_MARKER = re.compile(r"^<!-- run by the tests -->\n```python\n(.*?)```", re.S | re.M)
# The install and test commands: .ci/run runs them verbatim, so the command runner leaves them to it.
RUN_BY_CI = (("pip", "install"), ("python", "-m", "pytest"))


@dataclass(frozen=True)
class Shown:
    """One command of a page's bash block."""

    page: str  # the page's path under the repository
    line: str  # the command as written (comments and line continuations dropped)
    skip: str | None  # the page's reason for not running it, or None
    cwd: str = ""  # the folder a `cd DIR && ...` before it on its line names (relative), else ""

    @property
    def words(self) -> list[str]:
        return shlex.split(self.line)


def doc_pages() -> list[Path]:
    """README.md, then every page of the site in the order of mkdocs.yml's nav."""

    def paths(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in paths(item)]
        return [p for value in node.values() for p in paths(value)]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [ROOT / "README.md", *(ROOT / "docs" / page for page in paths(nav))]


def shown_commands(pages: list[Path] | None = None) -> list[Shown]:
    """Every command of the pages' bash blocks, in page order (`a && b` gives two commands)."""
    shown = []
    for page in pages if pages is not None else doc_pages():
        text = page.read_text()
        for match in re.finditer(r"(?:^([^\n]*)\n)?```bash\n(.*?)```", text, re.S | re.M):
            marker = SKIP_MARKER.search(match.group(1) or "")
            block = match.group(2).replace("\\\n", " ")
            for raw in block.splitlines():
                cwd = ""
                for part in raw.split("&&"):
                    line = _without_comment(part).strip()
                    if line.startswith("cd ") and len(shlex.split(line)) == 2:  # the folder of the rest of the line
                        cwd = shlex.split(line)[1]
                    elif line:
                        shown.append(Shown(str(page.relative_to(ROOT)), line, marker.group(1) if marker else None,
                                           cwd))
    return shown


def _without_comment(line: str) -> str:
    """The line up to a `#` that starts a comment (one after a blank, outside quotes)."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


def is_run_by_ci(shown: Shown) -> bool:
    return any(tuple(shown.words[:len(prefix)]) == prefix for prefix in RUN_BY_CI)


def doc_commands() -> list[list[str]]:
    """Every `meshformer ...` / `torchrun ... -m meshformer.train ...` command of the README and the docs, as words."""
    return [s.words for s in shown_commands() if s.words[:1] == ["meshformer"] or "meshformer.train" in s.words]


def readme_commands() -> list[list[str]]:
    """The README's own `meshformer` / `torchrun` commands, as words."""
    return [s.words for s in shown_commands([ROOT / "README.md"])
            if s.words[:1] == ["meshformer"] or "meshformer.train" in s.words]


def shown_files(page: Path) -> list[tuple[str, str]]:
    """The files a page shows for the reader to write, (relative path, text), in page order."""
    return [(m.group(1), m.group(2)) for m in FILE_MARKER.finditer(page.read_text())]


def shown_python(page: Path) -> list[str]:
    """The python blocks a page marks as run by the tests, in page order."""
    return [m.group(1) for m in RUN_MARKER.finditer(page.read_text())]
