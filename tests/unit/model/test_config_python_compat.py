"""The flat ModelConfig names of earlier releases (model/config_compat.py): each old name in RENAMES reads, writes
and constructs its typed place with one FutureWarning per name per process naming the new attribute, and nothing of
it reaches equality, asdict, copies, pickles or the saved TOML."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import tomllib
import typing
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.common import CONFIGS

from meshformer.config import load_config, migrate
from meshformer.config.migrate import get_dotted
from meshformer.model import config_compat
from meshformer.model.config import ModelConfig
from meshformer.model.config_compat import REMOVED_IN, RENAMES

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
ALIASED = sorted(k for k in RENAMES if k not in FIELDS)  # norm, init: now the sub-configs; their keywords still map


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    """Each test starts as a new process would: no name warned yet."""
    config_compat._warned.clear()
    yield
    config_compat._warned.clear()


def other_value(new: str, avoid: Any) -> Any:
    """A valid value of the typed attribute `new` ("attention.n_heads") that differs from `avoid`."""
    section, name = new.split(".")
    hint = typing.get_type_hints(type(getattr(ModelConfig(), section)))[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return next(a for a in args if a != avoid)
    kind = args[0] if args else hint
    if kind is bool:
        return not avoid
    if kind is int:
        return (avoid or 0) + 3
    return (avoid or 0.0) + 0.5


def renamed_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_the_aliases_and_the_toml_migration_read_one_table():
    assert migrate.RENAMES is RENAMES
    assert set(ALIASED) | {"norm", "init"} == set(RENAMES)


@pytest.mark.parametrize("old", sorted(RENAMES))
def test_an_old_name_maps_to_its_typed_place_and_warns_once(old):
    new = RENAMES[old]
    default = get_dotted(ModelConfig(), new)
    value = other_value(new, default)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = ModelConfig(**{old: value})
        assert get_dotted(built, new) == value
        if old in ALIASED:
            assert getattr(built, old) == value  # get
            setattr(built, old, default)  # set
            assert get_dotted(built, new) == default
        assert get_dotted(ModelConfig(**{old: value}), new) == value
    messages = renamed_warnings(caught)
    assert len(messages) == 1, messages  # once per name per process, however often it is used
    assert f"ModelConfig.{new}" in messages[0] and f"removed in {REMOVED_IN}" in messages[0]


@pytest.mark.parametrize("old", ALIASED)
def test_reading_and_writing_an_old_name_each_warn(old):
    new = RENAMES[old]
    cfg = ModelConfig()
    value = other_value(new, get_dotted(cfg, new))
    with pytest.warns(FutureWarning, match=f"use ModelConfig.{new} "):
        assert getattr(cfg, old) == get_dotted(cfg, new)
    config_compat._warned.clear()
    with pytest.warns(FutureWarning, match=f"use ModelConfig.{new} "):
        setattr(cfg, old, value)
    assert get_dotted(cfg, new) == value


def test_the_names_the_issue_named():
    with pytest.warns(FutureWarning):
        cfg = ModelConfig(rope_scaling="linear", n_heads=8, norm="rmsnorm", init="xavier")
    assert (cfg.rope.scaling, cfg.attention.n_heads, cfg.norm.kind, cfg.init.method) == ("linear", 8, "rmsnorm",
                                                                                         "xavier")
    with pytest.warns(FutureWarning):
        assert (cfg.n_heads, cfg.activation, cfg.norm_eps, cfg.norm_position) == (
            8, "gelu", 1e-5, "pre")


def test_an_old_window_slides_every_block_unless_a_pattern_is_given():
    with pytest.warns(FutureWarning):
        cfg = ModelConfig(attention_window=64)
    assert cfg.layer_types == ["sliding_attention"] and cfg.attention.window == 64
    pattern = ["sliding_attention", "full_attention"]
    assert ModelConfig(attention_window=64, layer_types=pattern).layer_types == pattern
    cfg = ModelConfig()
    cfg.attention_window = 32
    assert cfg.layer_types == ["sliding_attention"] and cfg.attention.window == 32


def test_unknown_names_fail_as_before_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AttributeError, match="n_head"):
            _ = ModelConfig().n_head
        with pytest.raises(TypeError, match="n_head"):
            ModelConfig(n_head=4)
    assert not renamed_warnings(caught)


def test_copies_pickles_equality_and_asdict_hold_only_the_typed_config():
    with pytest.warns(FutureWarning):
        old = ModelConfig(n_heads=8, rope_scaling="yarn", norm_eps=1e-6, activation="swiglu")
    new = ModelConfig(attention=dataclasses.replace(ModelConfig().attention, n_heads=8),
                      rope=dataclasses.replace(ModelConfig().rope, scaling="yarn"),
                      norm=dataclasses.replace(ModelConfig().norm, eps=1e-6),
                      ffn=dataclasses.replace(ModelConfig().ffn, activation="swiglu"))
    assert old == new and dataclasses.asdict(old) == dataclasses.asdict(new)
    assert set(dataclasses.asdict(old)) == FIELDS
    assert copy.deepcopy(old) == old and copy.copy(old) == old and pickle.loads(pickle.dumps(old)) == old
    changed = dataclasses.replace(old, n_heads=2)  # n_heads warned above: once is all
    assert changed.attention.n_heads == 2 and old.attention.n_heads == 8  # the original's sub-config untouched


def test_the_saved_toml_is_the_same_whichever_names_built_the_config():
    cfg = load_config(CONFIGS / "tiny-moe.toml")
    before = cfg.to_toml()
    with pytest.warns(FutureWarning):
        for old in ALIASED:
            if old != "attention_window":  # also sets layer_types, as the flat key did
                setattr(cfg.model, old, getattr(cfg.model, old))
        cfg.model = ModelConfig(**{**{f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelConfig)},
                                   "n_heads": cfg.model.attention.n_heads, "norm": cfg.model.norm.kind})
    assert cfg.to_toml() == before
    model = tomllib.loads(before)["model"]
    assert not [k for k in ALIASED if k in model] and all(isinstance(model[k], dict) for k in ("norm", "init"))
