"""What every optimizer file declares (`OptimizerSpec`), and the parameter-group rules they share.

An optimizer file holds its config table (a dataclass, `[optim.<name>]`), its torch optimizer, and one
`OptimizerSpec` subclass that answers what the rest of the program asks: the parameter groups and the optimizer
(train/step.py), the optimizer state's bytes per parameter (the planner), and how a checkpointed state tensor is
laid out on the current ranks (checkpointing/state.py, when a checkpoint is resharded to another layout).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

FP32 = 4  # bytes of one optimizer-state element: state is fp32 whatever the compute dtype


class SharedKeys(Protocol):
    """The `[optim]` keys every optimizer reads (config/sections.py: OptimConfig): AdamW's, which each optimizer
    applies to the parameters it does not treat itself (embeddings, norms, biases, the output head)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay for matrices (ndim >= 2: projections, embeddings, position tables), not for vectors (norms,
    biases, attention sinks) nor the experts' stacked biases (E, width), which are vectors per expert."""
    return param.ndim >= 2 and not name.endswith("_bias")


def unique_trainable(model_parts: Iterable[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Each trainable parameter once (tied weights appear under their first name), in model order."""
    seen: set[int] = set()
    out = []
    for part in model_parts:
        for name, param in part.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
    return out


class OptimizerSpec:
    """One optimizer as the program sees it. Subclasses set the class attributes and override `build`; the
    defaults describe an optimizer whose state is element-wise (every state tensor shaped like its parameter)."""

    name: ClassVar[str]  # optim.name, and the config table [optim.<name>]
    table: ClassVar[type]  # the dataclass of [optim.<name>]
    optimizer_class: ClassVar[type[torch.optim.Optimizer]]  # what `build` returns (checkpoints record its name)
    state_description: ClassVar[str]  # for the planner's assumptions, e.g. "AdamW moments 2 x fp32"

    def build(self, model_parts: list[nn.Module], shared: SharedKeys, table: Any
              ) -> tuple[torch.optim.Optimizer, str]:
        """The optimizer over the model's trainable parameters, and a one-line description for the run log."""
        raise NotImplementedError

    def check(self, table: Any) -> None:
        """Raise ConfigError for values of [optim.<name>] out of range (called for every table, used or not)."""

    def state_bytes(self, numel: int, matrix_numel: int, matrix_gather: int) -> tuple[float, float]:
        """(bytes of optimizer state held between steps, bytes of transient buffers while stepping) of one rank
        that holds `numel` parameter elements, `matrix_numel` of them in the blocks' matrices (`matrix`:
        optim/muon.py: is_muon_parameter), the largest of which has `matrix_gather` elements whole."""
        raise NotImplementedError

    def state_template(self, key: str, param: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor laid out as this rank holds state `key` of `param`, whose checkpointed (global) tensor
        has `shape`: resharding fills it from any saved layout. Default: shaped like the parameter, sharded as it
        is (moments); anything else (AdamW's scalar step) whole on every rank."""
        if tuple(shape) == tuple(param.shape):
            return torch.empty_like(param, dtype=dtype, requires_grad=False)
        return torch.empty(shape, dtype=dtype)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local piece of a DTensor (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t
