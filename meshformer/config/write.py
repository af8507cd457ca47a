"""The config tree as TOML: what a run writes to `<run_dir>/config.toml` and `load_config` reads back."""

from __future__ import annotations

import json
from typing import Any

import tomli_w


def dump_toml(tree: dict[str, Any]) -> str:
    """The config tree as TOML (None is omitted: it means "the default")."""
    return tomli_w.dumps(_without_none(tree))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def toml_value(value: Any) -> str:
    """One value for a log line, written as in a config (`"text"`, `[1, 2]`, `true`); None (unset) as `(unset)`."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (str, list, tuple, dict)):
        return json.dumps(_without_none(value), ensure_ascii=False)  # JSON strings and arrays read as TOML's
    return str(value)
