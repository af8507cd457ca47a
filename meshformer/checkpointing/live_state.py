"""A run's whole training state as one in-memory dict, for a replica group healing from a live peer.

The same pieces a checkpoint holds (checkpointing/state.py names them: model and optimizer tensors under
layout-independent keys, the optimizer's groups, the named JSON components, the step and the RNG streams), but
sent process to process instead of written: each tensor as this rank's local shard. The receiving rank holds the
same shard of the same layout (rank i of one replica group heals from rank i of another), so the shards are copied
in place, without a resharding load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshformer.checkpointing import state as st
from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.rng import capture_rng_state, restore_rng_state
from meshformer.checkpointing.train_state import Checkpointable, optional


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def live_state(run: Checkpointable) -> dict[str, Any]:
    """This rank's training state. Tensors are the live ones (not copies): the caller sends them before the next
    optimizer step changes them."""
    tensors = st.training_tensors(run.model_parts, run.optimizer)
    return {
        "tensors": {key: _local(value).detach() for key, value in tensors.items()},
        "shapes": {key: (tuple(value.shape), value.dtype) for key, value in tensors.items()},
        "param_groups": st.param_groups_state(run.optimizer, run.model_parts),
        "components": {name: component.state_dict() for name, component in run.components.items()},
        "train_state": run.state.state_dict(),
        "rng": capture_rng_state(),
    }


def load_live_state(run: Checkpointable, state: dict[str, Any]) -> None:
    """Make this rank's training state the peer's `live_state`: weights, optimizer state (created where this rank
    has none yet), schedule, data position, callbacks' state, step and RNG streams."""
    shapes = {key: (torch.Size(shape), dtype) for key, (shape, dtype) in state["shapes"].items()}
    model_t, optim_t, per_param = st.load_templates(run.model_parts, run.optimizer, shapes)
    received = state["tensors"]
    with torch.no_grad():
        for key, template in {**model_t.tensors, **optim_t.tensors}.items():
            local, sent = _local(template), received[key]
            if local.shape != sent.shape:
                raise CheckpointError(f"the peer's {key} shard has shape {tuple(sent.shape)}, this rank's "
                                      f"{tuple(local.shape)}: replica groups must run the same parallel layout")
            local.copy_(sent)
    st.apply_model(run.model_parts, model_t)
    optim_t.fill_copies()
    if per_param:
        st.apply_optimizer(run.optimizer, run.model_parts, per_param, state["param_groups"])
    for name, component in run.components.items():
        if name in state["components"] or not optional(component):
            component.load_state_dict(state["components"][name])
    run.state.load_state_dict(state["train_state"])
    restore_rng_state(state["rng"])
