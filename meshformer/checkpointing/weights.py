"""Final model weights as one safetensors file (plus the model config), gathered from any layout."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from meshformer.checkpointing.errors import CorruptCheckpointError
from meshformer.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict of one model part; a collective under FSDP/TP (every rank of its mesh calls it).

    Tensors are gathered one at a time, so at most one unsharded tensor is on the device at once.
    """
    if not torch.distributed.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    out = {}
    # FSDP x TP weights gather in two steps; torch warns about that on every rank, which is noise here.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for key, value in get_model_state_dict(model).items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            out[key] = full.detach().cpu()
    finally:
        redistribute_log.setLevel(level)
    return out


def gather_full_state(plan) -> dict[str, torch.Tensor] | None:
    """The whole model's unsharded state on rank 0 (None elsewhere), whatever the layout.

    Each tensor is sent once, by the lowest rank holding it: pipeline stages contribute their own layers,
    data- and tensor-parallel replicas send nothing twice.
    """
    local: dict[str, torch.Tensor] = {}
    for part in plan.model_parts:
        local.update(full_state_dict(part))
    if not torch.distributed.is_initialized():
        return local
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    all_keys: list[list[str] | None] = [None] * world
    dist.all_gather_object(all_keys, sorted(local))
    owner: dict[str, int] = {}
    for r, keys in enumerate(all_keys):
        for key in keys or []:
            owner.setdefault(key, r)
    mine = {k: v for k, v in local.items() if owner[k] == rank}
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(world)] if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    return {k: v for part in gathered for k, v in part.items()}


def save_weights(plan, directory: Path) -> Path | None:
    """Write model.safetensors + model_config.json from rank 0; returns the file path on rank 0."""
    state = gather_full_state(plan)
    if state is None:
        return None
    return write_weights(state, plan.model_parts[0].cfg, directory)


def write_weights(state: dict[str, torch.Tensor], cfg: ModelConfig, directory: Path) -> Path:
    """The weights folder format: model.safetensors (tied output dropped) and model_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = dict(state)
    if cfg.tie_embeddings:
        state.pop("output.weight", None)  # tied to tok_embeddings.weight; restored on load
    path = directory / WEIGHTS_FILE
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "meshformer"})
    (directory / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2))
    return path


def read_weights(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict with tied weights restored) of a weights folder."""
    from meshformer.config import build_section

    directory = Path(directory)
    if not (directory / WEIGHTS_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no {WEIGHTS_FILE} + {CONFIG_FILE}; point at a run's final/ "
                                "folder or the output of `meshformer convert to-safetensors`")
    try:
        cfg = build_section(ModelConfig, json.loads((directory / CONFIG_FILE).read_text()), "model")
        state = load_file(str(directory / WEIGHTS_FILE))
    except (ValueError, SafetensorError) as err:  # JSON, config keys, safetensors header
        raise CorruptCheckpointError(f"{directory} is not a readable weights folder ({err})",
                                     "re-export it (`meshformer convert to-safetensors`) or use the run's final/ "
                                     "folder") from None
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return cfg, state


def load_weights(directory: Path) -> nn.Module:
    """Rebuild a Transformer from a folder written by `save_weights`."""
    from meshformer.model import Transformer

    cfg, state = read_weights(directory)
    model = Transformer(cfg)
    model.load_state_dict(state, strict=True)
    return model
