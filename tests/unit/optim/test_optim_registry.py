"""The optimizer registry (meshformer/optim/): every registered optimizer is a valid optim.name with its own
[optim.<name>] table, and the flat [optim] keys of an earlier release migrate and keep working from Python."""

from __future__ import annotations

import dataclasses
import logging
import sys
import typing
import warnings

import pytest
import torch

from meshformer.config import OptimConfig, config_from_dict, load_config
from meshformer.config.optim_compat import OPTIM_RENAMES
from meshformer.optim import OPTIMIZERS, build_optimizer, get_optimizer_spec, spec_of
from meshformer.optim.muon import MuonConfig

OLD_VALUES = {"implementation": "foreach", "muon_lr": 0.02, "muon_weight_decay": 0.05, "muon_momentum": 0.9,
              "muon_ns_steps": 3, "muon_scale": "shape"}


def test_every_registered_optimizer_has_its_name_and_table():
    names = typing.get_args(typing.get_type_hints(OptimConfig)["name"])
    assert set(names) == set(OPTIMIZERS)
    fields = {f.name: f for f in dataclasses.fields(OptimConfig)}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    for name, spec in OPTIMIZERS.items():
        assert spec.name == name and fields[name].default_factory is spec.table  # type: ignore[comparison-overlap]
        optimizer, _ = build_optimizer([model], OptimConfig(name=name))
        assert type(optimizer) is spec.optimizer_class and spec_of(optimizer) is spec
        assert get_optimizer_spec(name).state_description


def test_every_flat_key_migrates_to_its_table(caplog):
    assert set(OLD_VALUES) == set(OPTIM_RENAMES)
    with caplog.at_level(logging.WARNING, logger="meshformer.config"):
        cfg = config_from_dict({"optim": {"name": "muon", **OLD_VALUES}})
    for old, new in OPTIM_RENAMES.items():
        table, key = new.split(".")
        assert getattr(getattr(cfg.optim, table), key) == OLD_VALUES[old], old
        assert f"optim.{old} is now optim.{new}" in caplog.text
    assert "muon_lr" not in cfg.to_toml() and "[optim.muon]" in cfg.to_toml()


def test_flat_key_and_its_new_key_disagreeing_is_an_error():
    from meshformer.config import ConfigError

    with pytest.raises(ConfigError, match=r"optim.muon_lr=0.02 and optim.muon.lr=0.03 disagree.*keep only"):
        config_from_dict({"optim": {"muon_lr": 0.02, "muon": {"lr": 0.03}}})


def test_flat_key_as_override(tmp_path):
    cfg = load_config(None, ['optim.name="muon"', "optim.muon_ns_steps=2", 'optim.implementation="for-loop"'])
    assert cfg.optim.muon.ns_steps == 2 and cfg.optim.adamw.implementation == "for-loop"


def test_old_python_names_work_and_warn_once_naming_the_new_one(monkeypatch):
    from meshformer.config import optim_compat

    monkeypatch.setattr(optim_compat, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = OptimConfig(muon_lr=0.5, implementation="foreach")
        assert cfg.muon == MuonConfig(lr=0.5) and cfg.adamw.implementation == "foreach"
        cfg.muon_momentum = 0.8
        assert cfg.muon.momentum == 0.8 and cfg.muon_momentum == 0.8 and cfg.muon_lr == 0.5
        other = dataclasses.replace(cfg, muon_lr=0.25)
        assert other.muon.lr == 0.25 and cfg.muon.lr == 0.5  # a copy: the original's table is untouched
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(messages) == 3  # muon_lr, implementation, muon_momentum: once each
    assert any("OptimConfig.muon_lr is deprecated" in m and "OptimConfig.muon.lr" in m for m in messages)
    assert "muon_lr" not in dataclasses.asdict(cfg)


def test_old_import_paths_warn():
    with pytest.warns(FutureWarning, match="meshformer.optim.build_optimizer"):
        from meshformer.train.optim import build_optimizer as old
    assert old is build_optimizer
    sys.modules.pop("meshformer.train.muon", None)  # the stand-in warns once per process
    with pytest.warns(FutureWarning, match="import meshformer.optim.muon"):
        from meshformer.train.muon import Muon
    assert Muon is get_optimizer_spec("muon").optimizer_class
