"""Sharded materialisation: a model built on the meta device gets only this rank's shards, initialised in place.

`parallelize` applies the layout (pipeline split, tensor parallel, FSDP) to the meta model first, so every
parameter already has its final (sharded) shape; `to_empty` then allocates just those shards on the device
and the model's own init rules fill them (meshformer.model.init): the values equal the single-process
model's bitwise, whatever the layout and world size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from meshformer.model import Transformer
from meshformer.model.init import init_buffers


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def materialize(parts: Sequence[nn.Module], device: torch.device, *, init: bool = True) -> None:
    """Allocate each part's local shards on `device`, recompute derived buffers and (unless weights are about
    to be loaded into them) initialise the parameters."""
    for part in parts:
        tied = _tied_slots(part)
        part.to_empty(device=device)
        _retie(tied)
        init_buffers(part)
        if init:
            assert isinstance(part, Transformer)  # a whole model or a pipeline stage of one
            part.spec.init(part)  # the family's own initialisation (Transformer.init_weights by default)


def _tied_slots(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) slots that hold one shared parameter, per parameter held more than once."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            slots.setdefault(id(param), []).append((module, name))
    return [group for group in slots.values() if len(group) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """`to_empty` gives a meta parameter a new object in each slot; put the first one back in all of them."""
    for (first, first_name), *rest in groups:
        for module, name in rest:
            setattr(module, name, getattr(first, first_name))
