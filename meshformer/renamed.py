"""Modules that moved to a name of their own (one name, one meaning: docs/design.md#words).

The old import path keeps working for two releases: its module file is a stand-in that puts the new module in its
place in `sys.modules`, with one FutureWarning per old path per process naming the new one.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

# the release that drops the old paths (two releases after they moved): stated in every warning
REMOVED_IN = "0.3"

# old import path -> new import path
MOVED: dict[str, str] = {
    "meshformer.checkpointing.errors": "meshformer.checkpointing.checkpoint_errors",
    "meshformer.checkpointing.progress": "meshformer.checkpointing.conversion_progress",
    "meshformer.train.fault_tolerance": "meshformer.train.replica_step",
    "meshformer.loss.spec": "meshformer.loss.token_loss",
    "meshformer.train.muon": "meshformer.optim.muon",
}


def moved(old: str) -> ModuleType:
    """The module `old` moved to, installed under the old name too (so the warning comes once per process)."""
    new = MOVED[old]
    warnings.warn(f"{old} is deprecated and will be removed in {REMOVED_IN}: import {new}", FutureWarning,
                  stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


_warned_attributes: set[str] = set()


def renamed_attribute(cls: type, old: str, new: str) -> None:
    """Give `cls` a read-only attribute `old` that returns `new`'s value, with one FutureWarning per old name per
    process naming the new one (a property added after the class is built: not a dataclass field, so `asdict`, `==`
    and saved files hold only the new name)."""
    label = f"{cls.__name__}.{old}"

    def read(self: object) -> object:
        if label not in _warned_attributes:
            _warned_attributes.add(label)
            warnings.warn(f"{label} is deprecated and will be removed in {REMOVED_IN}: use {cls.__name__}.{new}",
                          FutureWarning, stacklevel=2)
        return getattr(self, new)

    setattr(cls, old, property(read, doc=f"Deprecated: {cls.__name__}.{new}."))


def warn_renamed_key(old: str, new: str) -> None:
    """One FutureWarning per old key per process: `old` is deprecated, use `new`."""
    if old not in _warned_attributes:
        _warned_attributes.add(old)
        warnings.warn(f"{old} is deprecated and will be removed in {REMOVED_IN}: use {new}", FutureWarning,
                      stacklevel=4)


def renamed_names(module: str, names: dict[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` under which each old name in `names` (old -> new, both in `module`) still imports, with
    one FutureWarning per old name per process naming the new one. Modules define it under `if not TYPE_CHECKING`,
    so mypy does not offer the old names to new code."""

    def __getattr__(name: str) -> object:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        label = f"{module}.{name}"
        if label not in _warned_attributes:
            _warned_attributes.add(label)
            warnings.warn(f"{label} is deprecated and will be removed in {REMOVED_IN}: use {module}.{names[name]}",
                          FutureWarning, stacklevel=2)
        return getattr(sys.modules[module], names[name])

    return __getattr__
