"""Training state as layout-independent pieces: tensors keyed by plain-model FQNs, everything else as JSON.

Tensor keys never mention ranks, shards or stages ("model.decoder_layers.0.attn.q_proj.weight",
"optim.decoder_layers.0.attn.q_proj.weight.exp_avg"), and tensors keep their current sharding
(DTensor under FSDP/TP), so DCP can write any layout and read it back into any other one.
One optimizer may span several model parts (pipeline stages on one rank): its state is keyed by the
parameter's FQN, not by the optimizer's positional ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.model import Transformer
from meshformer.optim import OptimizerSpec, spec_of

MODEL = "model."
OPTIM = "optim."


def named_parameters(model_parts: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """(canonical FQN, parameter) over every part, each parameter object once.

    A weight tied in the plain model gets its first name even where a pipeline stage holds an untied copy
    under the other name (`Transformer.canonical_name`), so optimizer state matches across layouts. Two copies
    on one rank (first and last stage of a V schedule) share a name: the first is saved, both are loaded.
    """
    out, seen = [], set()
    for part in model_parts:
        named = part.canonical_parameters() if isinstance(part, Transformer) else part.named_parameters()
        for name, param in named:
            if id(param) not in seen:
                seen.add(id(param))
                out.append((name, param))
    return out


def named_buffers(model_parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(FQN, buffer) of the buffers a state dict holds (persistent ones: e.g. MoE routers' selection bias)."""
    out = []
    for part in model_parts:
        for module_name, module in part.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    out.append((f"{module_name}.{name}" if module_name else name, buffer))
    return out


# ----------------------------------------------------------------------------- tensors


@dataclass
class TensorState:
    """Flat tensors to save or fill, plus copies held a second time on this rank (filled from the first)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    copies: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        if key in self.tensors:
            if self.tensors[key] is not tensor:
                self.copies.append((key, tensor))
        else:
            self.tensors[key] = tensor

    def fill_copies(self) -> None:
        with torch.no_grad():
            for key, tensor in self.copies:
                tensor.copy_(self.tensors[key])


def model_tensors(model_parts: list[nn.Module]) -> TensorState:
    out = TensorState()
    for part in model_parts:
        for key, value in get_model_state_dict(part, options=StateDictOptions()).items():
            out.add(MODEL + key, cast(torch.Tensor, value))  # a model's state dict holds tensors
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer, model_parts: list[nn.Module]) -> TensorState:
    names = {id(p): n for n, p in named_parameters(model_parts)}
    out = TensorState()
    for param, state in optimizer.state.items():
        if id(param) not in names:
            raise CheckpointError("the optimizer holds a parameter that no model part owns; build the optimizer "
                                  "from parallel_model.model_parts")
        for key, value in state.items():
            if not torch.is_tensor(value):
                raise CheckpointError(f"optimizer state {names[id(param)]}.{key} is a {type(value).__name__}, "
                                      "not a tensor; only tensor optimizer state can be checkpointed")
            out.add(f"{OPTIM}{names[id(param)]}.{key}", value)
    return out


def training_tensors(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """What a save writes: the model's and the optimizer's tensors (each key once)."""
    tensors = model_tensors(model_parts).tensors
    if optimizer is not None:
        tensors.update(optimizer_tensors(optimizer, model_parts).tensors)
    return tensors


SavedEntry = tuple[torch.Size, torch.dtype]  # a tensor's global shape and dtype in the checkpoint


def load_templates(model_parts: list[nn.Module], optimizer: torch.optim.Optimizer | None,
                   saved: dict[str, SavedEntry], skip: frozenset[str] | set[str] = frozenset()
                   ) -> tuple[TensorState, TensorState, list[tuple[nn.Parameter, dict]]]:
    """Tensors of the current layout for DCP to fill in place: model, optimizer, and optimizer state by parameter.

    Optimizer state is created from the checkpoint's own index, laid out as the optimizer's spec says
    (optim/optimizer_spec.py: state_template): by default a tensor shaped like its parameter takes the parameter's
    sharding (DTensor under FSDP/TP) and anything else (AdamW's scalar step) is a plain CPU tensor.
    Parameters the checkpoint has no state for stay without state, as they were when saved.
    `skip`: model keys a partial load leaves as initialized (no optimizer state is loaded for them either).
    """
    model = model_tensors(model_parts)
    missing = sorted(k[len(MODEL):] for k in model.tensors if k not in saved and k not in skip)
    if missing:
        raise CheckpointError(f"the checkpoint has no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                              "it was saved for a different model (check model.* settings)")
    optim = TensorState()
    per_param: list[tuple[nn.Parameter, dict]] = []
    if optimizer is None or not any(k.startswith(OPTIM) for k in saved):
        return model, optim, per_param
    by_param: dict[str, list[str]] = {}
    for key in saved:
        if key.startswith(OPTIM):
            by_param.setdefault(key[len(OPTIM):].rsplit(".", 1)[0], []).append(key)
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    spec = spec_of(optimizer) or OptimizerSpec()  # its state's layout on this rank (resharding rule)
    for name, param in named_parameters(model_parts):
        if id(param) not in owned or MODEL + name in skip:
            continue
        tensors = {}
        for key in by_param.get(name, []):
            shape, dtype = saved[key]
            # Uninitialized is fine: DCP overwrites every element (or raises if the checkpoint lacks some).
            tensor = spec.state_template(key.rsplit(".", 1)[1], param, shape, dtype)
            tensors[key.rsplit(".", 1)[1]] = tensor
            optim.add(key, tensor)
        if tensors:
            per_param.append((param, tensors))
    return model, optim, per_param


def apply_optimizer(optimizer: torch.optim.Optimizer, model_parts: list[nn.Module],
                    per_param: list[tuple[nn.Parameter, dict]], saved_groups: list[dict[str, Any]],
                    allow_new: bool = False) -> None:
    """Hand the loaded state and the saved hyperparameters to the optimizer's own `load_state_dict`
    (which applies its device and dtype policy, e.g. where AdamW keeps `step`)."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
                              f"{len(optimizer.param_groups)}: the optimizer setup changed")
    names = {id(p): n for n, p in named_parameters(model_parts)}
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    groups = []
    for i, (group, entry) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ours = {names[id(p)] for p in group["params"]}
        if not allow_new and not ours <= set(entry["params"]):  # a pipeline stage holds a subset of the group
            extra = sorted(ours - set(entry["params"]))[:3]
            raise CheckpointError(f"optimizer group {i} holds {extra} here but not in the checkpoint: the "
                                  "grouping of parameters (weight decay or not) changed")
        restored = {k: _from_json(v, group.get(k)) for k, v in entry.items() if k != "params"}
        groups.append({**group, **restored, "params": [index[id(p)] for p in group["params"]]})
    state = {index[id(p)]: tensors for p, tensors in per_param}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def apply_model(model_parts: list[nn.Module], loaded: TensorState) -> None:
    """Copy loaded model tensors into each part (a no-op copy where DCP already loaded in place)."""
    for part in model_parts:
        keys = get_model_state_dict(part, options=StateDictOptions()).keys()
        set_model_state_dict(part, {k: loaded.tensors[MODEL + k] for k in keys}, options=StateDictOptions(strict=True))


def check_shapes(templates: dict[str, torch.Tensor], saved_shapes: dict[str, torch.Size]) -> None:
    for key, tensor in templates.items():
        if key not in saved_shapes:
            continue  # left out of a partial load
        if tuple(tensor.shape) != tuple(saved_shapes[key]):
            raise CheckpointError(f"{key} has shape {tuple(saved_shapes[key])} in the checkpoint but "
                                  f"{tuple(tensor.shape)} here: the checkpoint was saved for a different model "
                                  "(check model.* settings against the checkpoint's trainer_state.json)")


# ----------------------------------------------------------------------------- JSON pieces


def _to_json(value: Any) -> Any:
    if torch.is_tensor(value):
        return {"tensor": value.item()}
    if isinstance(value, tuple):
        return {"tuple": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store {type(value).__name__} {value!r} as JSON")


def _from_json(value: Any, like: Any = None) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        if torch.is_tensor(like):
            return torch.tensor(value["tensor"], dtype=like.dtype, device=like.device)
        return torch.tensor(value["tensor"])
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_from_json(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def param_groups_state(optimizer: torch.optim.Optimizer, model_parts: list[nn.Module]) -> list[dict[str, Any]]:
    names = {id(p): n for n, p in named_parameters(model_parts)}
    groups = []
    for group in optimizer.param_groups:
        entry = {k: _to_json(v) for k, v in group.items() if k != "params"}
        entry["params"] = [names[id(p)] for p in group["params"]]
        groups.append(entry)
    return groups


def scheduler_state(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    return {k: _to_json(v) for k, v in scheduler.state_dict().items()}


def load_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, saved: dict[str, Any]) -> None:
    """Restore the schedule's position. A LambdaLR schedule itself (optim.lr, schedule.*, train.steps) comes from
    this run's config, so a resume with another train.steps follows the new schedule from its first step."""
    configured = list(scheduler.base_lrs)
    scheduler.load_state_dict({k: _from_json(v) for k, v in saved.items()})
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and configured:
        scheduler.base_lrs = configured
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(configured, scheduler.lr_lambdas)]
        for group, base, lr in zip(scheduler.optimizer.param_groups, configured, lrs):
            group["initial_lr"], group["lr"] = base, lr
        scheduler._last_lr = lrs
