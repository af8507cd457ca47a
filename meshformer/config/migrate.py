"""The flat `[model]` keys of earlier releases -> the typed sub-tables (`[model.attention]`, `[model.rope]`, ...).

One table, `RENAMES` (model/config_compat.py: the deprecated Python attributes read it too), maps each old key to
its new dotted key (relative to `[model]`); the four pattern keys (`full_attention_every`, `attention_window`,
`moe_every`, `moe_first_dense`) become `model.layer_types` / `model.mlp_types`. Every reader of a `[model]` table
goes through `migrate_model_table`: a TOML file and its `--set` overrides (config/load.py), a checkpoint's or weights
folder's saved config (`model_from_dict`). A user's file gets one log line per old key; a saved config (written by
the program, not edited by people) gets one line.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

from meshformer.config.optim_compat import OPTIM_RENAMES  # [optim]'s table, as RENAMES is [model]'s
from meshformer.config.parse import build_section
from meshformer.errors import ConfigError
from meshformer.model.config import ModelConfig, attention_pattern, moe_pattern
from meshformer.model.config_compat import RENAMES, SECTION_RENAMES  # the Python names' aliases read them too

log = logging.getLogger("meshformer.config")

# old keys that become a per-block list (attention_window is also renamed: RENAMES)
PATTERNS: dict[str, str] = {"full_attention_every": "layer_types", "attention_window": "layer_types",
                            "moe_every": "mlp_types", "moe_first_dense": "mlp_types"}
Report = Literal["each", "once", "none"]
SUBTABLES = ("attention", "mla", "ffn", "rope", "norm", "moe", "init")


def old_keys(table: dict[str, Any]) -> list[str]:
    """The flat keys of an earlier release in a [model] table (a sub-table named as an old key is not one), and the
    old dotted names of keys renamed inside their sub-table (`SECTION_RENAMES`)."""
    flat = [k for k in table if (k in RENAMES or k in PATTERNS) and not (k in SUBTABLES and isinstance(table[k], dict))]
    return flat + [f"{s}.{k}" for s, sub in table.items() if s in SUBTABLES and isinstance(sub, dict) for k in sub
                   if f"{s}.{k}" in SECTION_RENAMES]


def migrate_model_table(table: dict[str, Any], where: str = "", report: Report = "each",
                        context: dict[str, Any] | None = None, depths: dict[str, Any] | None = None) -> dict[str, Any]:
    """`table` (a [model] table as read from TOML or JSON) with every old flat key moved to its new key; one log line
    per old key ("once": one line for the whole table, for configs the program saved; "none": silent). A new key
    given too with another value is a ConfigError. `context`: the (new-style) [model] table that `table` overrides,
    where the pattern keys find the window, the depth and the experts `table` does not set; `depths`: stack depths
    set elsewhere that win over the table's (--set model.n_layers: a per-block list is built for the run's depth)."""
    found = old_keys(table)
    if not found:
        return table
    out: dict[str, Any] = {k: (dict(v) if k in SUBTABLES and isinstance(v, dict) else v)
                           for k, v in table.items() if k not in found}
    for key in found:
        if key in PATTERNS and key not in RENAMES:
            continue
        if key in SECTION_RENAMES:
            _rename_in_section(out, key, where)
            continue
        _move_flat_key(table, out, key, "model", RENAMES[key], where)
    _patterns(table, out, where, context or {}, depths or {})
    if report == "once":
        log.info("config: %stranslated the flat [model] keys of an earlier release (%s) to the [model.*] tables",
                 _at(where), ", ".join(found))
    elif report == "each":
        for key in found:
            new = PATTERNS[key] if key in PATTERNS and key not in RENAMES else {**RENAMES, **SECTION_RENAMES}[key]
            log.warning("config: model.%s is now model.%s (translated; update %s to silence this)", key, new,
                        "the --set override" if where == "--set" else where or "the file")
    return out


def _rename_in_section(out: dict[str, Any], key: str, where: str) -> None:
    """model.<section>.<old> -> model.<section>.<new> in `out` (its sub-tables are copies)."""
    section, old = key.split(".")
    name = SECTION_RENAMES[key].split(".")[1]
    sub = out[section]
    value = sub.pop(old)
    if name in sub and sub[name] != value:
        raise ConfigError(f"{_at(where)}model.{key}={value!r} and model.{SECTION_RENAMES[key]}={sub[name]!r} "
                          "disagree", f"keep only model.{SECTION_RENAMES[key]}")
    sub[name] = value


def _patterns(table: dict[str, Any], out: dict[str, Any], where: str, context: dict[str, Any],
              depths: dict[str, Any]) -> None:
    """full_attention_every / attention_window -> layer_types; moe_every / moe_first_dense -> mlp_types."""

    def get(section: str | None, key: str, default: Any = None) -> Any:
        for tree in (depths, out, context):
            node = tree.get(section, {}) if section else tree
            if isinstance(node, dict) and node.get(key) is not None:
                return node[key]
        return default

    window = get("attention", "window")
    every = table.get("full_attention_every")
    if every is not None and (window is None or not isinstance(every, int) or every < 1):
        raise ConfigError(f"{_at(where)}model.full_attention_every={every} picks the blocks that skip the sliding "
                          "window, but needs model.attention.window and a value >= 1",
                          "set both (Gemma 3: attention_window=512, full_attention_every=6; now model.attention.window "
                          "and model.layer_types) or drop it")
    if "full_attention_every" in table:
        _set_list(out, "layer_types", attention_pattern(window, every), where)
    elif "attention_window" in table and not get(None, "layer_types"):  # a pattern given: the window is its
        _set_list(out, "layer_types", attention_pattern(window, None), where)
    if "moe_every" in table or "moe_first_dense" in table:
        moe_every, first_dense = table.get("moe_every", 1), table.get("moe_first_dense", 0)
        if not isinstance(moe_every, int) or moe_every < 1:
            raise ConfigError(f"{_at(where)}model.moe_every={moe_every} must be >= 1",
                              "1: every block is MoE; k: every k-th (now model.mlp_types)")
        if not isinstance(first_dense, int) or first_dense < 0:
            raise ConfigError(f"{_at(where)}model.moe_first_dense={first_dense} is negative",
                              "use a value >= 0 (now model.mlp_types)")
        if get("moe", "n_experts", 0):  # dense models: the old keys meant nothing
            depth = max(int(get(None, k) or get(None, "n_layers", ModelConfig.n_layers))
                        for k in ("n_layers", "n_encoder_layers", "n_decoder_layers"))
            _set_list(out, "mlp_types", moe_pattern(moe_every, first_dense, depth), where)


def _set_list(out: dict[str, Any], key: str, value: list[str], where: str) -> None:
    if key in out and list(out[key]) != value and not (not value and not out[key]):
        raise ConfigError(f"{_at(where)}model.{key}={out[key]!r} disagrees with the old pattern keys it replaces "
                          f"(they give {value!r})", f"keep only model.{key}")
    if value or key in out:
        out[key] = value


def migrate_optim_table(table: dict[str, Any], where: str = "", report: Report = "each") -> dict[str, Any]:
    """`table` (an [optim] table) with each flat key of an earlier release (`OPTIM_RENAMES`: muon_lr, ...) moved
    into its optimizer's table ([optim.muon] lr); reported as `migrate_model_table` reports."""
    found = [k for k in table if k in OPTIM_RENAMES]
    if not found:
        return table
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items() if k not in found}
    for key in found:
        _move_flat_key(table, out, key, "optim", OPTIM_RENAMES[key], where)
    if report == "once":
        log.info("config: %stranslated the flat [optim] keys of an earlier release (%s) to the [optim.*] tables",
                 _at(where), ", ".join(found))
    elif report == "each":
        for key in found:
            log.warning("config: optim.%s is now optim.%s (translated; update %s to silence this)", key,
                        OPTIM_RENAMES[key], "the --set override" if where == "--set" else where or "the file")
    return out


# keys of earlier releases that no longer mean anything: dropped, with why
REMOVED = {"downstream.engine": "in-loop evaluation always runs through lm-eval's evaluator"}


def migrate_tree(raw: dict[str, Any], where: str = "", report: Report = "each",
                 context: dict[str, Any] | None = None, depths: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole config tree with its [model] and [optim] tables migrated and the `REMOVED` keys dropped (other tables
    as they are)."""
    out = raw
    for dotted, why in REMOVED.items():
        section, key = dotted.split(".")
        table = out.get(section)
        if isinstance(table, dict) and key in table:
            out = {**out, section: {k: v for k, v in table.items() if k != key}}
            if report != "none":
                log.info("config: %s%s is no longer a key (%s); ignored", _at(where), dotted, why)
    model, optim = raw.get("model"), raw.get("optim")
    if isinstance(model, dict) and old_keys(model):
        out = {**out, "model": migrate_model_table(model, where, report, context, depths)}
    if isinstance(optim, dict) and any(k in OPTIM_RENAMES for k in optim):
        out = {**out, "optim": migrate_optim_table(optim, where, report)}
    return out


def model_from_dict(raw: dict[str, Any], where: str = "", report: Report = "once") -> ModelConfig:
    """A ModelConfig from a saved [model] table of any release (a checkpoint's, a weights folder's)."""
    return build_section(ModelConfig, migrate_model_table(raw, where, report), "model")


def model_from_flat(**keys: Any) -> ModelConfig:
    """A ModelConfig from keyword arguments named as the flat keys (what an adapter reading another program's
    config assembles), nested silently; the new names (attention=AttentionConfig(...), layer_types) pass through."""
    table = migrate_model_table(keys, report="none")
    nested = {k: v for k, v in table.items() if not isinstance(v, dict)}
    built = ModelConfig(**nested)
    for section in SUBTABLES:
        if isinstance(table.get(section), dict):
            setattr(built, section, type(getattr(built, section))(**table[section]))
    return built


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"attention": {"n_heads": 4}} -> {"attention.n_heads": 4}: a nested table's keys, dotted."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _move_flat_key(table: dict[str, Any], out: dict[str, Any], key: str, top: str, new: str, where: str) -> None:
    """A flat key of the [top] `table` into its sub-table of `out` (`new`: "section.name"), refusing a different
    value already there."""
    section, name = new.split(".")
    sub = out.setdefault(section, {})
    if not isinstance(sub, dict):
        raise ConfigError(f"{_at(where)}{top}.{section} must be a table ([{top}.{section}])")
    if name in sub and sub[name] != table[key]:
        raise ConfigError(f"{_at(where)}{top}.{key}={table[key]!r} and {top}.{new}={sub[name]!r} disagree",
                          f"keep only {top}.{new}")
    sub[name] = table[key]


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def get_flat(cfg: ModelConfig, key: str) -> Any:
    """The value of an old flat key (or of any ModelConfig attribute) on a ModelConfig: `n_heads` reads
    cfg.attention.n_heads."""
    if key in RENAMES:
        section, name = RENAMES[key].split(".")
        return getattr(getattr(cfg, section), name)
    return getattr(cfg, key)


def get_dotted(cfg: Any, key: str) -> Any:
    """cfg.attention.n_heads for "attention.n_heads"."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def with_dotted(cfg: Any, changes: dict[str, Any]) -> Any:
    """A copy of the dataclass `cfg` with the dotted keys of `changes` set ({"attention.n_heads": 8})."""
    direct: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    direct.update({head: with_dotted(getattr(cfg, head), sub) for head, sub in nested.items()})
    return dataclasses.replace(cfg, **direct)


def dotted_values(cfg: Any) -> dict[str, Any]:
    """{"attention.n_heads": 4, ...}: every key of a (nested) config dataclass, dotted."""
    return flatten(dataclasses.asdict(cfg))
