"""What a training checkpoint holds, named explicitly: the run's counters and its stateful components.

    state = TrainState(device)                                   # step, tokens seen
    run = Checkpointable(state, parallel_model.model_parts, optimizer,
                         {"scheduler": SchedulerState(scheduler), "data": loader}, cfg)
    manager.resume(run); manager.after_step(run); manager.finish(run)

Model parts and optimizer are saved as sharded tensors under layout-independent names (DCP), so any parallel
layout can load them; every other component is a `Stateful` whose `state_dict()` is plain JSON, stored by name in
trainer_state.json. The RNG streams are process-global and saved per rank by the manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from meshformer.checkpointing import state as st
from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.config import Config


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class TrainState:
    """The optimizer steps taken and the target tokens trained on. The token count stays on the training device,
    so adding to it each step costs no host sync; it is read on the host only when a checkpoint is saved."""

    def __init__(self, device: torch.device | str = "cpu", step: int = 0) -> None:
        self.step = step
        self.tokens_seen = torch.zeros((), dtype=torch.long, device=device)

    @property
    def device(self) -> torch.device:
        return self.tokens_seen.device

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": int(self.tokens_seen)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.tokens_seen.fill_(int(state_dict.get("tokens_seen", 0)))


class SchedulerState:
    """A learning-rate scheduler as a `Stateful` with JSON state (tensors and tuples tagged)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return st.scheduler_state(self.scheduler)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        st.load_scheduler(self.scheduler, state_dict)


def optional(component: Stateful) -> bool:
    """A component with `optional = True` may be absent from a checkpoint (one saved before it existed): a resume
    leaves it as it is. Any other must find its state there."""
    return bool(getattr(component, "optional", False))


@runtime_checkable
class TensorComponent(Protocol):
    """Training state held in tensors laid out like the model's (DiLoCo's outer state): saved in the checkpoint's
    tensor files under its name, and loaded in place."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a save writes (this rank's tensors; DTensors for sharded ones)."""
        ...

    def load_templates(self, saved: set[str]) -> dict[str, torch.Tensor]:
        """Tensors to load in place, for the keys the checkpoint holds (`saved`, without the name)."""
        ...

    def loaded(self, keys: set[str]) -> None:
        """After the load: the keys it filled (none where the checkpoint had none)."""
        ...


@dataclass
class Checkpointable:
    """Everything a training checkpoint saves and a resume restores."""

    state: TrainState
    model_parts: list[nn.Module]
    optimizer: torch.optim.Optimizer
    components: Mapping[str, Stateful]  # by name in trainer_state.json: scheduler, data loader, ...
    config: Config
    # by name in the tensor files (keys "<name>.<key>"): optional, a checkpoint without them still loads
    tensor_components: dict[str, TensorComponent] = field(default_factory=dict)

    def component_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{key}": tensor for name, component in self.tensor_components.items()
                for key, tensor in component.tensors().items()}

    def component_templates(self, saved: Iterable[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Per component: its templates (keys without the name) for the tensors the checkpoint holds."""
        saved = list(saved)
        out = {}
        for name, component in self.tensor_components.items():
            prefix = f"{name}."
            out[name] = component.load_templates({k[len(prefix):] for k in saved if k.startswith(prefix)})
        return out

    def __post_init__(self) -> None:
        for name, component in self.components.items():
            if name in RESERVED:
                raise CheckpointError(f"component name {name!r} is taken by trainer_state.json itself; rename it")
            if not isinstance(component, Stateful):
                # Skipping it would resume with this component reset: no longer the same run.
                raise CheckpointError(f"checkpoint component {name!r} ({type(component).__name__}) has no "
                                      "state_dict()/load_state_dict(); give it both so that a resume restores it, "
                                      "or leave it out of the checkpointed components")


# Keys trainer_state.json uses for itself ("kind": `contents` in files of earlier releases); components may not
# shadow them.
RESERVED = frozenset({"version", "contents", "kind", "optimizer", "step", "tokens_seen", "param_groups", "world_size",
                      "config", "saved_at", "components"})


def saved_contents(state: Mapping[str, object]) -> object:
    """What a checkpoint holds, from its trainer_state.json: "training" (weights, optimizer and trainer state) or
    "weights" (weights alone); files of earlier releases say it as "kind"."""
    return state.get("contents", state.get("kind"))
