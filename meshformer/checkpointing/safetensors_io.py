"""Sharded training checkpoint <-> single-file safetensors weights folder (model.safetensors + model_config.json).

Both directions run in one process without a process group: DCP reads and writes whole tensors whatever
layout saved them. The reverse direction writes a weights-only checkpoint (always step 0) that training
starts from at step 0 with a fresh optimizer and schedule: the way to start from imported (e.g. Hugging Face) weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from meshformer.checkpointing import directory
from meshformer.checkpointing.checkpoint_errors import CheckpointError, CorruptCheckpointError
from meshformer.checkpointing.commit import commit, partial_dir
from meshformer.checkpointing.dcp_io import (
    read_full_tensors,
    read_metadata,
    save_tensors_streamed,
    tensor_entries,
)
from meshformer.checkpointing.manifest import MANIFEST, verify_manifest, write_json_atomic
from meshformer.checkpointing.sharded_safetensors import DEFAULT_MAX_SHARD_SIZE, has_safetensors
from meshformer.checkpointing.state import MODEL
from meshformer.checkpointing.weights import (
    CONFIG_FILE,
    missing_tensors_error,
    open_weights,
    saved_names,
    write_weights,
)
from meshformer.config import ModelConfig
from meshformer.config.migrate import model_from_dict
from meshformer.data import Tokenizer
from meshformer.data.tokenizer import check_vocab


def resolve_checkpoint(path: Path) -> Path:
    """A committed step folder, or the newest valid one in a checkpoint directory (manifest verified)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        verify_manifest(path, "sha256")
        return path
    steps = directory.committed_steps(path)
    for step in reversed(steps):
        candidate = path / directory.step_dir_name(step)
        try:
            verify_manifest(candidate, "sha256")
            return candidate
        except CorruptCheckpointError:
            continue
    raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a directory holding a valid "
                          "step-N/ checkpoint; pass a run's checkpoints/ folder or one of its step folders")


def checkpoint_model_config(path: Path) -> ModelConfig:
    state = json.loads((Path(path) / directory.TRAINER_STATE).read_text())
    return model_from_dict(state["config"]["model"], str(path))


class LazyState(Mapping[str, torch.Tensor]):
    """Name -> tensor, read from disk on each access and not cached: conversions stream tensor by tensor."""

    def __init__(self, names: list[str], read: Callable[[str], torch.Tensor],
                 meta: Callable[[str], torch.Tensor] | None = None) -> None:
        self._names, self._read, self._meta = list(names), read, meta

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of the entry's shape and dtype (read from the file's index where it has one)."""
        return self._meta(name) if self._meta else self[name].to("meta")

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._read(name)

    def __contains__(self, name: object) -> bool:  # without reading the tensor, as Mapping's default would
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_checkpoint_model(path: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, LazyState]:
    """(model config, model tensors read one at a time on access) of a sharded checkpoint, whatever layout."""
    path = resolve_checkpoint(path)
    cfg = checkpoint_model_config(path)
    metadata = read_metadata(path)  # once: each tensor's read below reuses it
    entries = {k[len(MODEL):]: v for k, v in tensor_entries(metadata).items() if k.startswith(MODEL)}
    return cfg, LazyState(sorted(entries),
                          lambda name: read_full_tensors(path, [MODEL + name], metadata)[MODEL + name],
                          lambda name: torch.empty(entries[name].size, dtype=entries[name].properties.dtype,
                                                   device="meta"))


def lazy_weights(path: Path) -> tuple[ModelConfig, LazyState]:
    """(model config, tensors read on access) of a weights folder, single-file or sharded; tied output restored."""
    cfg, folder = open_weights(path)
    names = folder.keys()
    if missing := [name for name in saved_names(cfg) if name not in folder]:
        raise missing_tensors_error(folder.source, missing)
    tied = cfg.tie_embeddings and "output.weight" not in folder

    def stored(name: str) -> str:
        return "tok_embeddings.weight" if tied and name == "output.weight" else name

    return cfg, LazyState([*names, "output.weight"] if tied else names, lambda name: folder.get(stored(name)),
                          lambda name: folder.meta(stored(name)))


def read_model_source(path: Path, *, show_progress: bool | None = None) -> tuple[ModelConfig, Mapping]:
    """A weights folder (safetensors + model_config.json) or a sharded checkpoint, read lazily."""
    path = Path(path)
    if has_safetensors(path) and (path / CONFIG_FILE).is_file():
        return lazy_weights(path)
    return read_checkpoint_model(path, show_progress=show_progress)


def checkpoint_to_safetensors(checkpoint: Path, out_dir: Path, *, show_progress: bool | None = None,
                              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tokenizer: Tokenizer | None = None
                              ) -> Path:
    cfg, state = read_checkpoint_model(checkpoint, show_progress=show_progress)
    if tokenizer is not None:
        check_vocab(tokenizer, cfg.vocab_size, "--tokenizer")
    return write_weights(state, cfg, out_dir, max_shard_size, tokenizer)


def write_weights_checkpoint(state: Mapping[str, torch.Tensor], cfg: ModelConfig, root: Path,
                             tokenizer: Tokenizer | None = None) -> Path:
    """A committed, weights-only checkpoint step-00000000/ under `root`: training starts from these weights at
    step 0 with a fresh optimizer, schedule and data order (a weights-only checkpoint carries no step). It carries
    `tokenizer` as a run's checkpoints do, so conversions of it pass it on."""
    step = 0
    from meshformer.model import Transformer

    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"these weights do not fit the config: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}")
    refuse_existing_checkpoints(root)
    partial = partial_dir(root, step)
    directory.remove_tree(partial)
    partial.mkdir(parents=True)
    # Streamed: a LazyState is read one tensor at a time as DCP writes it.
    templates = {MODEL + k: state.meta(k) if isinstance(state, LazyState) else state[k] for k in expected}
    save_tensors_streamed(templates, lambda key: state[key[len(MODEL):]], partial)
    write_json_atomic(partial / directory.TRAINER_STATE,
                      {"version": 1, "contents": "weights", "step": step, "tokens_seen": 0,
                       "config": {"model": asdict(cfg)}, "saved_at": time.time()})
    if tokenizer is not None:
        tokenizer.save(partial / directory.TOKENIZER_FILE)
    return commit(partial, step, {"world_size": 1})


def refuse_existing_checkpoints(root: Path, fix: str = "write the weights-only checkpoint into an empty folder"
                                ) -> None:
    """Resume takes the newest step: a weights-only step 0 written beside committed steps would be ignored."""
    if existing := directory.committed_steps(Path(root)):
        raise CheckpointError(f"{root} already holds checkpoints (steps {existing[:5]})", fix)


def safetensors_to_checkpoint(weights_dir: Path, root: Path, tokenizer: Tokenizer | None = None) -> Path:
    """A weights folder -> a weights-only checkpoint (step 0) under `root`, carrying `tokenizer`."""
    cfg, state = lazy_weights(weights_dir)
    return write_weights_checkpoint(state, cfg, root, tokenizer)
