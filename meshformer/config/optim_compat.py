"""The flat `[optim]` keys of earlier releases (`optim.muon_lr`, `optim.implementation`) as deprecated aliases of
the optimizers' own tables (`optim.muon.lr`, `optim.adamw.implementation`).

`OPTIM_RENAMES` is the one table of old key -> new dotted key below `[optim]`: the TOML migration
(config/migrate.py) and the Python aliases of `OptimConfig` read it. Each old attribute reads and writes its new
place and each old constructor keyword is accepted, with one FutureWarning per name per process naming the new
attribute; the aliases are properties, not fields (asdict and the saved TOML hold only the tables).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

# one deprecation horizon and one property shape for every renamed config key
from meshformer.model.config_compat import REMOVED_IN, renamed_alias

OPTIM_RENAMES: dict[str, str] = {
    "implementation": "adamw.implementation",
    "muon_lr": "muon.lr",
    "muon_weight_decay": "muon.weight_decay",
    "muon_momentum": "muon.momentum",
    "muon_ns_steps": "muon.ns_steps",
    "muon_scale": "muon.scale",
}

_warned: set[str] = set()


def warn_renamed(old: str, stacklevel: int = 3) -> None:
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(f"OptimConfig.{old} is deprecated and will be removed in {REMOVED_IN}: use "
                  f"OptimConfig.{OPTIM_RENAMES[old]} (the [optim.{OPTIM_RENAMES[old].split('.')[0]}] table)",
                  FutureWarning, stacklevel=stacklevel)


def install_optim_renamed(cls: type) -> None:
    """Give the dataclass `cls` (OptimConfig) the old flat names as properties and constructor keywords."""
    for old, new in OPTIM_RENAMES.items():
        setattr(cls, old, renamed_alias(old, new, warn_renamed))
    init = vars(cls)["__init__"]  # the dataclass-generated one

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        old = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIM_RENAMES}
        init(self, *args, **kwargs)
        for key, value in old.items():
            warn_renamed(key)
            table, name = OPTIM_RENAMES[key].split(".")
            # a copy: dataclasses.replace(cfg, muon_lr=...) hands in the original's table
            setattr(self, table, dataclasses.replace(getattr(self, table), **{name: value}))

    cls.__init__ = __init__  # type: ignore[misc]
