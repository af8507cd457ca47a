"""Final model weights as one safetensors file (plus the model config), gathered from any layout."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from meshformer.config import ModelConfig


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict; a collective under FSDP/TP (every rank must call it)."""
    if torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def save_weights(plan, directory: Path) -> Path | None:
    """Write model.safetensors + model_config.json from rank 0; returns the file path on rank 0."""
    state: dict[str, torch.Tensor] = {}
    for part in plan.model_parts:
        state.update(full_state_dict(part))
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank != 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    cfg: ModelConfig = plan.model_parts[0].cfg
    if cfg.tie_embeddings:
        state.pop("output.weight", None)  # tied to tok_embeddings.weight; restored on load
    path = directory / "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "meshformer"})
    (directory / "model_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    return path


def load_weights(directory: Path) -> nn.Module:
    """Rebuild a Transformer from a folder written by `save_weights`."""
    from meshformer.config import build_section
    from meshformer.model import Transformer

    directory = Path(directory)
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(f"{directory} holds no model.safetensors; point at a run's final/ folder")
    cfg = build_section(ModelConfig, json.loads((directory / "model_config.json").read_text()), "model")
    model = Transformer(cfg)
    state = load_file(str(directory / "model.safetensors"))
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state, strict=True)
    return model
