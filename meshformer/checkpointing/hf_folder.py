"""Hugging Face model folders (config.json + safetensors) <-> meshformer weights folders and checkpoints.

The name and layout mapping lives in hf.py; this module only reads and writes folders. Export goes through
transformers' own `save_pretrained`, so what it writes is exactly what `from_pretrained` expects. Import
reads the tensors directly (safetensors, or pytorch_model.bin with weights_only=True), without building
the HF model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file

from meshformer.checkpointing.errors import ConversionError
from meshformer.checkpointing.mapping import export_tensors
from meshformer.checkpointing.progress import progress
from meshformer.checkpointing.sharded_safetensors import DEFAULT_MAX_SHARD_SIZE, ShardedWriter
from meshformer.config import ModelConfig


def export_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, arch: str | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a folder that transformers loads with AutoModelFor...from_pretrained; returns the folder.

    Tensors go out one at a time (read from `state` on access, mapped, written into HF-style shards); tied
    duplicates are left out, as save_pretrained leaves them out, and transformers re-ties them on load.
    """
    from meshformer.checkpointing import hf

    try:
        arch = arch or hf.infer_arch(cfg)
        hf.check_compatible(cfg, arch)
    except ValueError as err:
        raise ConversionError(f"cannot export to Hugging Face: {err}") from None
    out_dir = Path(out_dir)
    hf.config_to_hf(cfg, arch).save_pretrained(str(out_dir))
    writer = ShardedWriter(out_dir, max_shard_size)
    for name, tensor in hf_tensors(state, cfg, arch):
        writer.add(name, tensor)
    writer.close()
    return out_dir


def hf_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time, tied aliases left out; BERT gets its folded position table back."""
    from meshformer.checkpointing import hf

    for rule in hf._RULES[arch](cfg):
        if not rule.alias:
            yield from export_tensors(state, [rule]).items()
    if arch == "bert":
        positions = state["pos_embeddings.weight"].detach()
        yield hf._BERT_POSITIONS, positions
        yield hf._BERT_TOKEN_TYPES, positions.new_zeros(2, cfg.d_model)  # BertConfig's type_vocab_size


def read_hf_state(folder: Path, *, show_progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder: model.safetensors, a sharded safetensors index, or pytorch_model.bin."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConversionError(f"{folder} has no model.safetensors, model.safetensors.index.json or "
                              "pytorch_model.bin; point at a folder written by save_pretrained")
    state: dict[str, torch.Tensor] = {}
    for file in progress(files, desc="reading safetensors", enabled=show_progress, unit="file"):
        state.update(load_file(str(file)))
    return state


def import_hf(folder: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(our config, our full state dict) from an HF GPT-2 / BERT / Llama / T5 folder."""
    from transformers import AutoConfig

    from meshformer.checkpointing import hf

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json; point at a Hugging Face model folder")
    hf_config = AutoConfig.from_pretrained(str(folder))
    try:
        cfg = hf.config_from_hf(hf_config)
        state = hf.from_hf_state_dict(read_hf_state(folder, show_progress=show_progress), cfg, hf_config.model_type)
    except (ValueError, KeyError) as err:
        raise ConversionError(f"cannot import {folder}: {err}") from None
    return cfg, state
