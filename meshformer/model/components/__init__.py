"""The block components: token mixers and channel mixers by kind (see `base.py` for what a kind declares).

Adding a kind: write one module in this package that subclasses `TokenMixer` or `ChannelMixer` and registers an
instance (`register(MyKind())`); every module here is imported with the package, so no list elsewhere names it.
The block builder, tensor parallel, FLOPs and parameter counts, the planner and config validation look kinds up here.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import TypeVar

from meshformer.model.components.base import ChannelMixer, Component, TokenMixer
from meshformer.model.config import ModelConfig

TOKEN_MIXERS: dict[str, TokenMixer] = {}
CHANNEL_MIXERS: dict[str, ChannelMixer] = {}
# The attribute of a TransformerBlock that holds each kind of mixer
TOKEN_MIXER, CROSS_MIXER, CHANNEL_MIXER = "attn", "cross_attn", "ffn"
CROSS_ATTENTION = "cross_attention"  # the token mixer of a cross-attending stack's blocks over the encoder memory
C = TypeVar("C", TokenMixer, ChannelMixer)


def register(kind: C) -> C:
    """Make `kind` the token or channel mixer called `kind.name`."""
    table: dict = TOKEN_MIXERS if isinstance(kind, TokenMixer) else CHANNEL_MIXERS
    if kind.name in table and type(table[kind.name]) is not type(kind):
        raise ValueError(f"a block component called {kind.name!r} is already registered")
    table[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove the kind called `name` (tests register toy kinds)."""
    TOKEN_MIXERS.pop(name, None)
    CHANNEL_MIXERS.pop(name, None)


def component(name: str) -> Component:
    """The token or channel mixer called `name`."""
    return TOKEN_MIXERS[name] if name in TOKEN_MIXERS else CHANNEL_MIXERS[name]


def token_mixer(cfg: ModelConfig, block: int) -> TokenMixer:
    """The token mixer of block `block` (from 0) of a stack."""
    return TOKEN_MIXERS[cfg.layer_type(block)]


def channel_mixer(cfg: ModelConfig, block: int) -> ChannelMixer:
    """The channel mixer of block `block` (from 0) of a stack."""
    return CHANNEL_MIXERS[cfg.mlp_type(block)]


def cross_mixer() -> TokenMixer:
    return TOKEN_MIXERS[CROSS_ATTENTION]


def block_mixers(cfg: ModelConfig, block: int, *, cross: bool) -> dict[str, Component]:
    """Block attribute -> the kind it holds, in execution order."""
    mixers: dict[str, Component] = {TOKEN_MIXER: token_mixer(cfg, block)}
    if cross:
        mixers[CROSS_MIXER] = cross_mixer()
    mixers[CHANNEL_MIXER] = channel_mixer(cfg, block)
    return mixers


def model_kinds(cfg: ModelConfig) -> Iterator[Component]:
    """Every kind the blocks of `cfg`'s stacks hold, once each, in order of first use."""
    from meshformer.model.families import get_family_spec  # the families' formulas import this package

    seen: set[str] = set()
    for stack in get_family_spec(cfg.family).stacks:
        for block in range(stack.count(cfg)):
            for kind in block_mixers(cfg, block, cross=stack.cross).values():
                if kind.name not in seen:
                    seen.add(kind.name)
                    yield kind


def _import_kinds() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


_import_kinds()

__all__ = ["CHANNEL_MIXERS", "CROSS_ATTENTION", "TOKEN_MIXERS", "ChannelMixer", "TokenMixer", "block_mixers",
           "channel_mixer", "component", "cross_mixer", "model_kinds", "register", "token_mixer", "unregister"]
