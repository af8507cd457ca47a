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
from typing import TYPE_CHECKING, Any

import torch

from meshformer.checkpointing.errors import ConversionError
from meshformer.checkpointing.mapping import iter_export, name_map
from meshformer.checkpointing.sharded_safetensors import (
    DEFAULT_MAX_SHARD_SIZE,
    SafetensorsFolder,
    ShardedWriter,
    has_safetensors,
)
from meshformer.config import ModelConfig

if TYPE_CHECKING:
    from meshformer.checkpointing.hf import Arch
    from meshformer.model.families.naming import Rule


def export_hf(state: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: Path, arch: Arch | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a folder that transformers loads with AutoModelFor...from_pretrained; returns the folder.

    Tensors go out one at a time (read from `state` on access, mapped, written into HF-style shards); tied
    duplicates are left out, as save_pretrained leaves them out, and transformers re-ties them on load.
    """
    from meshformer.checkpointing import hf

    try:
        arch = arch or hf.infer_arch(cfg)
        hf.check_compatible(cfg, arch)
        hf.check_exportable(state, arch)
    except ValueError as err:
        raise ConversionError(f"cannot export to Hugging Face: {err}", "choose another --arch, or leave it out to "
                              "pick the one that matches") from None
    out_dir = Path(out_dir)
    hf.config_to_hf(cfg, arch).save_pretrained(str(out_dir))
    writer = ShardedWriter(out_dir, max_shard_size)
    for name, tensor in hf_tensors(state, cfg, arch):
        writer.add(name, tensor)
    writer.close()
    return out_dir


def hf_tensors(state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) one at a time, tied aliases left out; BERT gets its folded position table back."""
    from meshformer.checkpointing import hf

    yield from iter_export(state, [rule for rule in name_map(cfg, arch) if not rule.alias])
    if arch == "bert":
        positions = state["pos_embeddings.weight"].detach()
        yield hf._BERT_POSITIONS, positions
        yield hf._BERT_TOKEN_TYPES, positions.new_zeros(2, cfg.d_model)  # BertConfig's type_vocab_size


def hf_source(folder: Path) -> Mapping[str, torch.Tensor]:
    """The tensors of an HF folder, read on access: model.safetensors or a sharded index (pytorch_model.bin,
    a single pickle, is loaded whole with weights_only=True)."""
    from meshformer.checkpointing.safetensors_io import LazyState

    folder = Path(folder)
    if has_safetensors(folder):
        files = SafetensorsFolder(folder)
        return LazyState(files.keys(), files.get, files.meta)
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConversionError(f"{folder} has no model.safetensors, model.safetensors.index.json or "
                          "pytorch_model.bin; point at a folder written by save_pretrained")


def lazy_from_hf(theirs: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch) -> Mapping[str, torch.Tensor]:
    """Our tensors computed from `theirs` on access (one foreign tensor read per tensor of ours).

    Names are checked up front, without reading data: every foreign tensor must be used (or be a known
    weightless buffer), every tensor of ours must have a source.
    """
    from meshformer.checkpointing import hf
    from meshformer.checkpointing.mapping import ZERO_ON_IMPORT, check_names, import_tensors, our_shapes
    from meshformer.checkpointing.safetensors_io import LazyState

    hf.check_compatible(cfg, arch)
    original = hf._normalize_names({k: k for k in theirs}, arch)  # normalised name -> name in the files
    shapes = our_shapes(cfg)
    source = f"Hugging Face {arch}"
    rules = name_map(cfg, arch)
    rules_of: dict[str, list[Rule]] = {}  # our tensor -> the rules giving it (one, or one per expert)
    for rule in rules:
        if rule.alias:
            continue
        if rule.theirs not in original:
            raise KeyError(f"{source} state dict lacks {rule.theirs!r} (needed for {', '.join(rule.ours)})")
        for name in rule.ours:
            rules_of.setdefault(name, []).append(rule)
    ours = [*rules_of, *(["pos_embeddings.weight"] if arch == "bert" else [])]
    check_names(ours, cfg, shapes, hf.unused_names(original, {r.theirs for r in rules}, arch), source)
    tied = cfg.tie_embeddings and "output.weight" in shapes

    def read(name: str) -> torch.Tensor:
        if tied and name == "output.weight":
            name = "tok_embeddings.weight"
        if arch == "bert" and name == "pos_embeddings.weight":  # token type 0 folded into the positions
            types = original.get(hf._BERT_TOKEN_TYPES)
            return (theirs[original[hf._BERT_POSITIONS]] + (theirs[types][0] if types else 0.0)).contiguous()
        if ZERO_ON_IMPORT.search(name):
            return torch.zeros(shapes[name])
        mine = rules_of[name]
        try:
            return import_tensors({r.theirs: theirs[original[r.theirs]] for r in mine}, mine, shapes, source)[0][name]
        except ValueError as err:  # a shape that does not fit the config
            raise ConversionError(str(err)) from None

    return LazyState(list(shapes), read)


def open_hf(folder: Path) -> tuple[ModelConfig, Arch, Mapping[str, torch.Tensor]]:
    """(our config, the architecture, its tensors read on access under their own names) of a Hugging Face
    folder: only config.json and the files' headers are read."""
    from meshformer.checkpointing import hf

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{folder} has no config.json; point at a Hugging Face model folder")
    theirs = hf_source(folder)
    hf_config = _read_config(folder / "config.json", len(theirs))
    try:
        return hf.config_from_hf(hf_config), hf_config.model_type, theirs
    except (ValueError, KeyError) as err:
        raise ConversionError(f"cannot import {folder}: {err}") from None


def import_hf(folder: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """(our config, our tensors read on access) from a Hugging Face folder of one of `hf.ARCHS`."""
    cfg, arch, theirs = open_hf(folder)
    try:
        return cfg, lazy_from_hf(theirs, cfg, arch)
    except (ValueError, KeyError) as err:
        raise ConversionError(f"cannot import {folder}: {err}") from None


def _read_config(path: Path, n_tensors: int) -> Any:
    """transformers' config of `path`, its sizes checked first; a value transformers rejects is named too."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from meshformer.checkpointing import hf

    fix = "fix that value in config.json, or point at the folder save_pretrained wrote"
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError("it is not a JSON object")
        hf.check_sizes(raw, n_tensors)
        return AutoConfig.from_pretrained(str(path.parent))
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        raise ConversionError(f"{path}: {_first_line(err)}", fix) from None


def _first_line(err: BaseException) -> str:
    """transformers' validation errors span lines (the key on the first); the one-line form keeps it."""
    return " ".join(str(err).split("\n", 2)[:2])
