"""The one way in: `load_config` reads TOML (a file or a bundled config's name), applies `section.key=value`
overrides and validates; `config_from_dict` does the same for a tree already in memory.

    cfg = load_config("configs/tiny-gpt.toml", ["train.steps=200", "model.n_layers=4"])
    cfg = load_config("tiny-gpt")  # a bundled config by name (shipped inside the package)
"""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from meshformer.config import migrate
from meshformer.config.migrate import migrate_tree
from meshformer.config.parse import build_section
from meshformer.config.sections import Config
from meshformer.config.validate import validate
from meshformer.errors import ConfigError

_GIVEN = "_given_keys"  # a loaded Config's attribute (not a config key): what `given_keys` returns


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a TOML file (or defaults), apply `section.key=value` overrides, validate."""
    raw: dict[str, Any] = {}
    bundled = False
    if path is not None:
        bundled = not Path(path).is_file()  # named by its bundle name: a template, not the user's own file
        path = resolve_config_path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})", "fix the line it names") from None
    overridden: dict[str, Any] = {}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.steps=200")
        _set_dotted(overridden, key.strip(), _parse_value(value.strip()))
    if path is not None:
        # stack depths set with --set: a flat file's per-block mlp_types is built for the run's depth
        given = overridden.get("model")
        depths = {k: v for k, v in given.items() if k.endswith("layers")} if isinstance(given, dict) else {}
        raw = migrate_tree(raw, str(path), depths=depths)
    if bundled and any(isinstance(tree.get("checkpoint"), dict) and tree["checkpoint"].get("init_from")
                       for tree in (raw, overridden)):
        # continued pretraining: the model is the folder's, so a bundled config's from-scratch [model] yields to it
        # (keys set with --set are the user's, and checked against the folder)
        raw.pop("model", None)
    model = raw.get("model")
    overridden = migrate_tree(overridden, "--set", context=model if isinstance(model, dict) else None)
    for key, value in migrate.flatten(overridden).items():
        _set_dotted(raw, key, value)
    _callback_folders(raw, Path.cwd() if path is None or bundled else path.parent)
    return config_from_dict(raw)


def _callback_folders(raw: dict[str, Any], base: Path) -> None:
    """Each [[callbacks]] table's `folder`, made absolute against `base` (the config file's folder): every rank and a
    resume then look its module up in the same place, wherever they start."""
    tables = raw.get("callbacks")
    for table in tables if isinstance(tables, list) else []:
        if isinstance(table, dict) and isinstance(table.get("folder", ""), str):
            table["folder"] = str((base / table.get("folder", "")).absolute())


def bundled_configs() -> dict[str, Path]:
    """The configs shipped inside the package, by name (`tiny-gpt`, `llama-8b`, ...)."""
    folder = Path(__file__).parents[1] / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.toml"))}


DESCRIPTION = "# description: "  # a bundled config's first line: what `meshformer config list` says of it


def config_description(path: Path) -> str:
    """The one-line description a bundled config opens with ("" when it has none)."""
    first = path.read_text().partition("\n")[0]
    return first.removeprefix(DESCRIPTION).strip() if first.startswith(DESCRIPTION) else ""


def resolve_config_path(path: str | Path) -> Path:
    """A TOML file, or the name of a bundled config."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    bundled = bundled_configs()
    if str(path) in bundled:
        return bundled[str(path)]
    if candidate.is_dir():
        raise ConfigError(f"config {str(path)!r} is a folder; pass a TOML file or a bundled config name "
                          f"({', '.join(bundled)})")
    hint = difflib.get_close_matches(candidate.stem, bundled, n=1)
    fix = f"did you mean {hint[0]!r}? " if hint else ""
    raise ConfigError(f"config file {str(path)!r} not found; {fix}pass a TOML file or a bundled config name "
                      f"({', '.join(bundled)})")


def config_from_dict(raw: dict[str, Any]) -> Config:
    """A validated config from a TOML-shaped tree of sections (what `load_config` reads from a file)."""
    raw = migrate_tree(raw)
    cfg = build_section(Config, raw, "")
    validate(cfg)
    setattr(cfg, _GIVEN, frozenset(f"{section}.{key}" for section, table in raw.items() if isinstance(table, dict)
                                   for key in migrate.flatten(table)))
    return cfg


def given_keys(cfg: Config) -> frozenset[str]:
    """The dotted keys the user wrote (`model.attention.n_heads`; in the TOML file or an override), whatever their
    values, defaults included:
    a value equal to the default was still asked for. Empty for a config not loaded from a tree."""
    return getattr(cfg, _GIVEN, frozenset())


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as rmsnorm or a path


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is a value, not a section")
    node[parts[-1]] = value
