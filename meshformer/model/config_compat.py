"""The flat `ModelConfig` names of earlier releases (`cfg.n_heads`, `ModelConfig(rope_scaling=...)`) as deprecated
aliases of the typed sub-configs (`cfg.attention.n_heads`, `cfg.rope.scaling`).

`RENAMES` is the one table of old flat key -> new dotted key below `[model]`: TOML migration (config/migrate.py)
reads it too, from here because the model layer may not import the config layer. Each old name reads and writes its
new place and takes the constructor's keyword, with one FutureWarning per name per process naming the new attribute;
the aliases are properties added after the dataclass is built, so they are not fields (asdict, ==, the saved TOML
and pickles hold only the typed config) and mypy does not offer them to new code.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

# the release that drops the aliases (two releases after the typed config's 0.1): stated in every warning
REMOVED_IN = "0.3"

# old flat [model] key -> its key below [model]
RENAMES: dict[str, str] = {
    "n_heads": "attention.n_heads", "n_kv_heads": "attention.n_kv_heads", "head_dim": "attention.head_dim",
    "qk_norm": "attention.qk_norm", "qk_norm_scope": "attention.qk_norm_scope", "qkv_bias": "attention.qkv_bias",
    "attention_dropout": "attention.dropout", "attention_window": "attention.window",
    "attention_softcap": "attention.softcap", "attention_scale": "attention.scale",
    "document_mask": "attention.document_mask", "attention_backend": "attention.backend",
    "relative_buckets": "attention.relative_buckets", "relative_max_distance": "attention.relative_max_distance",
    "d_ff": "ffn.d_ff", "activation": "ffn.activation",
    "rope_theta": "rope.theta", "rope_scaling": "rope.scaling", "rope_scaling_factor": "rope.factor",
    "rope_original_max_seq_len": "rope.original_max_seq_len", "rope_low_freq_factor": "rope.low_freq_factor",
    "rope_high_freq_factor": "rope.high_freq_factor", "rope_beta_fast": "rope.beta_fast",
    "rope_beta_slow": "rope.beta_slow", "rope_attention_factor": "rope.attention_factor",
    "rope_local_theta": "rope.local_theta",
    "norm": "norm.kind", "norm_eps": "norm.eps", "norm_position": "norm.position", "final_norm": "norm.final",
    "norm_weight_offset": "norm.weight_offset", "embedding_norm": "norm.embedding",
    "n_experts": "moe.n_experts", "experts_per_token": "moe.experts_per_token", "moe_d_ff": "moe.d_ff",
    "n_shared_experts": "moe.n_shared_experts", "router_score": "moe.router_score",
    "router_renormalize": "moe.router_renormalize", "router_groups": "moe.router_groups",
    "router_groups_per_token": "moe.router_groups_per_token",
    "router_group_score": "moe.router_group_score", "capacity_factor": "moe.capacity_factor",
    "moe_aux_loss": "moe.aux_loss", "moe_aux_per_sequence": "moe.aux_per_sequence",
    "router_z_loss": "moe.router_z_loss", "router_bias_update_rate": "moe.router_bias_update_rate",
    "moe_backend": "moe.backend",
    "init": "init.method", "init_std": "init.std",
    "attention_sinks": "attention.sinks", "swiglu_limit": "ffn.swiglu_limit", "swiglu_alpha": "ffn.swiglu_alpha",
    "rope_truncate": "rope.truncate", "router_bias": "moe.router_bias", "expert_bias_terms": "moe.expert_linear_bias",
    "router_scale": "moe.router_scale",
}

# a key renamed inside its sub-table: old dotted key -> new dotted key below [model] (TOML migration reads it too;
# the sub-config class takes the old name as a deprecated attribute and keyword: `install_section_renames`)
SECTION_RENAMES: dict[str, str] = {
    "moe.expert_bias_terms": "moe.expert_linear_bias",  # "expert bias" is the router's selection-bias buffer
}

_warned: set[str] = set()


def warn_renamed(old: str, stacklevel: int = 3) -> None:
    """One FutureWarning per old name per process (FutureWarning, not DeprecationWarning: shown to scripts' users
    by default, not only under a test runner)."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"ModelConfig.{old} is deprecated and will be removed in {REMOVED_IN}: use "
                  f"ModelConfig.{RENAMES[old]} (the [model.{RENAMES[old].split('.')[0]}] table)",
                  FutureWarning, stacklevel=stacklevel)


def renamed_alias(old: str, new: str, warn: Callable[[str], None],
                  after_set: Callable[[Any, str, Any], None] | None = None) -> property:
    """A config's old flat name `old` as a property reading and writing `new` ("table.name"), `warn(old)` first."""
    section, name = new.split(".")

    def get(cfg: Any) -> Any:
        warn(old)
        return getattr(getattr(cfg, section), name)

    def put(cfg: Any, value: Any) -> None:
        warn(old)
        setattr(getattr(cfg, section), name, value)
        if after_set is not None:
            after_set(cfg, old, value)

    return property(get, put, doc=f"Deprecated (removed in {REMOVED_IN}): {new}.")


def _old_window_pattern(cfg: Any, old: str, value: Any) -> None:
    """The flat attention_window made every block slide (unless a pattern said otherwise): so does its alias, as
    the TOML migration does."""
    if old == "attention_window" and value is not None and not cfg.layer_types:
        from meshformer.model.config import attention_pattern  # that module installs these aliases

        cfg.layer_types = attention_pattern(value, None)


def install_renamed(cls: type) -> None:
    """Give the dataclass `cls` (ModelConfig) the old flat names: a property per old name that is not a field of
    its own (`norm` and `init` now name the sub-configs: only their constructor keywords map, given as strings), and
    an `__init__` that maps old keywords onto the sub-configs."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for old, new in RENAMES.items():
        if old not in fields:
            setattr(cls, old, renamed_alias(old, new, warn_renamed, _old_window_pattern))
    init = vars(cls)["__init__"]  # the dataclass-generated one

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        old = {k: kwargs.pop(k) for k in list(kwargs) if k in RENAMES and not _is_section(k, kwargs[k], fields)}
        init(self, *args, **kwargs)
        for key, value in old.items():
            warn_renamed(key)
            section, name = RENAMES[key].split(".")
            # a copy: dataclasses.replace(cfg, n_heads=8) hands in the original's sub-config
            setattr(self, section, dataclasses.replace(getattr(self, section), **{name: value}))
            if "layer_types" not in kwargs:
                _old_window_pattern(self, key, value)

    cls.__init__ = __init__  # type: ignore[misc]


def _is_section(key: str, value: Any, fields: set[str]) -> bool:
    """`norm=NormConfig(...)` is the field; `norm="rmsnorm"` the old key."""
    return key in fields and dataclasses.is_dataclass(value)


def install_section_renames(cls: type, section: str) -> None:
    """Give the sub-config dataclass `cls` (the [model.<section>] table) its keys' old names (`SECTION_RENAMES`): a
    property and a constructor keyword each, with one FutureWarning per name per process naming the new one."""
    renames = {old.split(".")[1]: new.split(".")[1] for old, new in SECTION_RENAMES.items()
               if old.split(".")[0] == section}

    def warn(old: str) -> None:
        label = f"{cls.__name__}.{old}"
        if label not in _warned:
            _warned.add(label)
            warnings.warn(f"{label} is deprecated and will be removed in {REMOVED_IN}: use {cls.__name__}."
                          f"{renames[old]} (model.{section}.{renames[old]})", FutureWarning, stacklevel=3)

    def alias(old: str) -> property:
        def get(cfg: Any) -> Any:
            warn(old)
            return getattr(cfg, renames[old])

        def put(cfg: Any, value: Any) -> None:
            warn(old)
            setattr(cfg, renames[old], value)

        return property(get, put, doc=f"Deprecated (removed in {REMOVED_IN}): {renames[old]}.")

    for old in renames:
        setattr(cls, old, alias(old))
    init = vars(cls)["__init__"]  # the dataclass-generated one

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for old in [k for k in kwargs if k in renames]:
            warn(old)
            kwargs[renames[old]] = kwargs.pop(old)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
