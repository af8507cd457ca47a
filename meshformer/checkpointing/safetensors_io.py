"""Sharded training checkpoint <-> single-file safetensors weights folder (model.safetensors + model_config.json).

Both directions run in one process without a process group: DCP reads and writes whole tensors whatever
layout saved them. The reverse direction writes a weights-only checkpoint (always step 0) that training
starts from at step 0 with a fresh optimizer and schedule: the way to start from imported (e.g. Hugging Face) weights.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from meshformer.checkpointing import directory as layout
from meshformer.checkpointing.commit import commit, partial_dir
from meshformer.checkpointing.dcp_io import read_full_tensors, read_metadata, save_tensors, tensor_entries
from meshformer.checkpointing.errors import CheckpointError, CorruptCheckpointError
from meshformer.checkpointing.manifest import MANIFEST, verify_manifest, write_json_atomic
from meshformer.checkpointing.progress import chunks, progress
from meshformer.checkpointing.state import MODEL
from meshformer.checkpointing.weights import CONFIG_FILE, WEIGHTS_FILE, read_weights, write_weights
from meshformer.config import ModelConfig, build_section


def resolve_checkpoint(path: Path) -> Path:
    """A committed step folder, or the newest valid one in a checkpoint directory (manifest verified)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        verify_manifest(path, "sha256")
        return path
    steps = layout.committed_steps(path)
    for step in reversed(steps):
        candidate = path / layout.step_dir_name(step)
        try:
            verify_manifest(candidate, "sha256")
            return candidate
        except CorruptCheckpointError:
            continue
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a directory holding a valid "
                          "step-N/ checkpoint; pass a run's checkpoints/ folder or one of its step folders")


def checkpoint_model_config(path: Path) -> ModelConfig:
    state = json.loads((Path(path) / layout.TRAINER_STATE).read_text())
    return build_section(ModelConfig, state["config"]["model"], "model")


def read_checkpoint_model(path: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, dict]:
    """(model config, full model state dict) of a sharded checkpoint, whatever layout wrote it."""
    path = resolve_checkpoint(path)
    cfg = checkpoint_model_config(path)
    keys = sorted(k for k in tensor_entries(read_metadata(path)) if k.startswith(MODEL))
    state: dict[str, torch.Tensor] = {}
    for group in progress(chunks(keys, 32), total=(len(keys) + 31) // 32, desc="reading checkpoint",
                          enabled=show_progress, unit="chunk"):
        state.update({k[len(MODEL):]: v for k, v in read_full_tensors(path, group).items()})
    return cfg, state


def read_model_source(path: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, dict]:
    """A weights folder (model.safetensors + model_config.json) or a sharded checkpoint."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
        return read_weights(path)
    return read_checkpoint_model(path, show_progress=show_progress)


def checkpoint_to_safetensors(checkpoint: Path, out_dir: Path, *, show_progress: bool | None = None) -> Path:
    cfg, state = read_checkpoint_model(checkpoint, show_progress=show_progress)
    return write_weights(state, cfg, out_dir)


def write_weights_checkpoint(state: dict[str, torch.Tensor], cfg: ModelConfig, root: Path) -> Path:
    """A committed, weights-only checkpoint step-00000000/ under `root`: training starts from these weights at
    step 0 with a fresh optimizer, schedule and data order (a weights-only checkpoint carries no step)."""
    step = 0
    from meshformer.model import Transformer

    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"these weights do not fit the config: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    if existing := layout.committed_steps(Path(root)):  # resume takes the newest step: the import would be ignored
        raise CheckpointError(f"{root} already holds checkpoints (steps {existing[:5]})",
                              "write the weights-only checkpoint into an empty folder")
    partial = partial_dir(root, step)
    layout.remove_tree(partial)
    partial.mkdir(parents=True)
    save_tensors({MODEL + k: state[k].contiguous() for k in expected}, partial)
    write_json_atomic(partial / layout.TRAINER_STATE, {"version": 1, "kind": "weights", "step": step, "tokens_seen": 0,
                                                "config": {"model": asdict(cfg)}, "saved_at": time.time()})
    return commit(partial, step, {"world_size": 1})


def safetensors_to_checkpoint(weights_dir: Path, root: Path) -> Path:
    """A weights folder -> a weights-only checkpoint (step 0) under `root`."""
    cfg, state = read_weights(weights_dir)
    return write_weights_checkpoint(state, cfg, root)
