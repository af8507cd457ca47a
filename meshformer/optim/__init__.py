"""The optimizer registry: one file per optimizer (adamw.py, muon.py, normuon.py), each declaring its config table
`[optim.<name>]`, its parameter groups and torch optimizer, its state bytes per parameter (the planner) and its
state's layout on the ranks (checkpoint resharding); see `optimizer_spec.OptimizerSpec`. Adding one: its file, one
line in `OPTIMIZERS`, and its table as a field of `OptimConfig` (config/sections.py) with its name in `optim.name`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshformer.optim.adamw import AdamWConfig, AdamWSpec
from meshformer.optim.muon import MuonConfig, MuonSpec
from meshformer.optim.normuon import NorMuonConfig, NorMuonSpec
from meshformer.optim.optimizer_spec import OptimizerSpec, SharedKeys, decays

OPTIMIZERS: dict[str, OptimizerSpec] = {spec.name: spec for spec in (AdamWSpec(), MuonSpec(), NorMuonSpec())}


def get_optimizer_spec(name: str) -> OptimizerSpec:
    return OPTIMIZERS[name]


def spec_of(optimizer: torch.optim.Optimizer) -> OptimizerSpec | None:
    """The spec whose `build` made `optimizer` (None: one built elsewhere, e.g. by a test)."""
    return next((s for s in OPTIMIZERS.values() if type(optimizer) is s.optimizer_class), None)


def build_optimizer(model_parts: list[nn.Module], cfg: Any) -> tuple[torch.optim.Optimizer, str]:
    """`cfg`: the `[optim]` config (config/sections.py: OptimConfig): its shared keys and its `[optim.<name>]`
    table. Returns the optimizer and a description of its kernel for the run log."""
    spec = OPTIMIZERS[cfg.name]
    shared: SharedKeys = cfg
    return spec.build(list(model_parts), shared, getattr(cfg, cfg.name))


__all__ = ["OPTIMIZERS", "AdamWConfig", "MuonConfig", "NorMuonConfig", "OptimizerSpec", "build_optimizer", "decays",
           "get_optimizer_spec", "spec_of"]
