"""Deprecated import path (removed in 0.3): Muon lives in meshformer/optim/muon.py, the optimizer registry's file."""

from __future__ import annotations

import warnings

from meshformer.optim import muon as _moved


def __getattr__(name: str) -> object:
    if name.startswith("__"):  # the import system's own probes (__path__, ...)
        raise AttributeError(name)
    warnings.warn(f"meshformer.train.muon.{name} is deprecated and will be removed in 0.3: use "
                  f"meshformer.optim.muon.{name}", FutureWarning, stacklevel=2)
    return getattr(_moved, name)
