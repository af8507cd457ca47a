"""Raw TOML values -> typed sections: unknown keys and wrong types become a `ConfigError` naming the key.

Also the one reader of byte sizes ("5GB", "2GiB") that config keys such as checkpoint.max_shard_size hold.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Literal

from meshformer.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"[{prefix}] must be a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        where = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {(prefix + '.' if prefix else '') + close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {where!r}{hint} (valid: {', '.join(fields)})")
        kwargs[key] = _coerce(hints[key], value, where)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, where: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build_section(hint, value, where)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, where)
            except ConfigError as err:
                errors.append(str(err))
        if len(options) == 1:
            raise ConfigError(errors[0])
        # e.g. bool | Literal["off", "blocks", "model"]: name every valid value, not only the first type's
        valid = [v for option in options for v in _valid_values(option)]
        raise ConfigError(f"{where} = {value!r} is not valid", f"use one of {', '.join(valid)}")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint_txt = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where} = {value!r} is not one of {list(args)}{hint_txt}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return {_coerce(args[0], k, where): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where} must have {len(args)} items, got {value!r}")
            return tuple(_coerce(a, v, where) for a, v in zip(args, value))
        item = args[0] if args else Any
        out = [_coerce(item, v, where) for v in value]
        return tuple(out) if origin is tuple else out
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{where} must be {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    return value


def _valid_values(hint: Any) -> list[str]:
    """How a union member is written in TOML: its literal values, true/false, or its type's name."""
    if typing.get_origin(hint) is Literal:
        return [repr(v) for v in typing.get_args(hint)]
    if hint is bool:
        return ["true", "false"]
    return [getattr(hint, "__name__", str(hint))]


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB" (10^9, as Hugging Face counts) or "4GiB" (2^30)."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"cannot read the size {size!r}; write e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
