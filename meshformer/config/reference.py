"""The reference of every config key: its table, type, default and meaning, read from the section dataclasses.

A key's meaning is the comment on its line, or the comment lines right above it, in the dataclass's source
(meshformer/config/sections.py, meshformer/model/config.py): the one place a key is described. `meshformer config
keys` prints it, and docs/config-reference.md is this module's output (a test keeps the two equal).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize
from typing import Any

_FIELD = re.compile(r"^\s+(\w+)\s*:")
ARRAYS_OF_TABLES = ("data.sources", "callbacks")  # written [[name]]: one table per item


def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the source of a dataclass: the trailing comment, else the comment block above."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        match = _FIELD.match(line)
        if not match or line.strip().startswith("#"):
            continue
        text = comments.get(number) if not line.lstrip().startswith("#") and "#" in line else None
        if text is None:  # the comment lines right above the field
            above: list[str] = []
            at = number - 1
            while at >= 1 and lines[at - 1].strip().startswith("#"):
                above.insert(0, comments.get(at, ""))
                at -= 1
            text = " ".join(above)
        found[match.group(1)] = text
    return found


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "(table)"
    return str(value)


def _type(f: dataclasses.Field) -> str:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return text.replace("Literal", "one of ").replace("|", "or")


def sections() -> list[tuple[str, type]]:
    """(TOML table, dataclass) of every table of the config tree, nested tables ([model.attention], [[data.sources]])
    right after their parent."""
    from meshformer.config.sections import CallbackConfig, Config, DataConfig, DataSourceConfig

    found: list[tuple[str, type]] = []

    def walk(name: str, cls: type) -> None:
        found.append((name, cls))
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(value := _default(f)):
                walk(f"{name}.{f.name}", type(value))
        if cls is DataConfig:
            found.append(("data.sources", DataSourceConfig))

    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(_default(f)):
            walk(f.name, type(_default(f)))
    found.append(("callbacks", CallbackConfig))
    return found


def undocumented_keys() -> list[str]:
    return [f"{table}.{name}" for table, cls in sections() for name, text in _described(cls) if not text]


def _described(cls: type) -> list[tuple[str, str]]:
    comments = field_comments(cls)
    return [(f.name, comments.get(f.name, "")) for f in dataclasses.fields(cls)
            if not dataclasses.is_dataclass(_default(f))]


def config_reference(table: str | None = None) -> str:
    """Markdown: one table of keys per config table (or only `table`)."""
    out = ["# Configuration keys", "",
           "Every key of a run's TOML config, by table: its type, its default and what it does. Set one on the "
           "command line with `--set table.key=value`. Generated from the config's dataclasses "
           "(`meshformer config keys`).", ""]
    for name, cls in sections():
        if table and name != table:
            continue
        out += [f"## [[{name}]]" if name in ARRAYS_OF_TABLES else f"## [{name}]", ""]
        doc = inspect.getdoc(cls)
        if doc and not doc.startswith(cls.__name__ + "("):
            out += [doc.split("\n\n")[0].replace("\n", " "), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(_default(f)):
                continue  # a table of its own, below
            meaning = comments.get(f.name, "").replace("|", "\\|")
            kind = _type(f).replace("|", "\\|")
            out.append(f"| `{f.name}` | {kind} | `{_show(_default(f))}` | {meaning} |")
        out.append("")
    return "\n".join(out)
