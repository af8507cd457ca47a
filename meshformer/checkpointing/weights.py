"""Final model weights as safetensors (one file, or HF-style shards + index) plus the model config.

Saving streams: every tensor is gathered on its own (`full_tensor()`, a collective over the ranks that hold
it), sent to rank 0 by the lowest rank holding it, and rank 0 writes each file once, holding at most one
file's worth. Loading reads tensor by tensor (or only this rank's slice of each), never a whole state dict.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from meshformer.checkpointing.errors import CorruptCheckpointError
from meshformer.checkpointing.sharded_safetensors import (
    DEFAULT_MAX_SHARD_SIZE,
    SINGLE_FILE,
    SafetensorsFolder,
    ShardedWriter,
    has_safetensors,
)
from meshformer.config import ModelConfig
from meshformer.errors import MeshformerError
from meshformer.model import Transformer

WEIGHTS_FILE = SINGLE_FILE
CONFIG_FILE = "model_config.json"
_METADATA = {"format": "meshformer"}


def saved_names(cfg: ModelConfig, names: Iterable[str] | None = None) -> list[str]:
    """The tensors a weights folder holds, in model order: the state dict (`names`, else built on meta) less the
    tied output weight."""
    if names is None:
        with torch.device("meta"):
            names = list(Transformer(cfg).state_dict())
    return [n for n in names if not (cfg.tie_embeddings and n == "output.weight")]


@contextlib.contextmanager
def quiet_redistribute() -> Iterator[None]:
    """FSDP x TP weights gather in two steps; torch warns about that on every rank, which is noise here."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def gathered_tensors(parallel_model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) on rank 0, in model order, one at a time; a collective every rank iterates.

    Each tensor is gathered by the ranks holding it and sent once, by the lowest of them: pipeline stages
    contribute their own layers, data- and tensor-parallel replicas send nothing twice.
    """
    from torch.distributed.tensor import DTensor

    from meshformer.checkpointing.state import named_buffers, named_parameters

    local = dict(named_parameters(parallel_model.model_parts)) | dict(named_buffers(parallel_model.model_parts))
    cfg = parallel_model.model_parts[0].cfg
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}  # of tensors other ranks send
    names = saved_names(cfg, shapes)
    dtype = next(iter(local.values())).dtype
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    owner = dict.fromkeys(local, 0)
    if distributed:
        held: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(held, sorted(local))
        owner = {}
        for r, keys in enumerate(held):
            for key in keys or []:
                owner.setdefault(key, r)
    missing = [n for n in names if n not in owner]
    if missing:
        raise RuntimeError(f"no rank holds {missing[:5]}: the parallel model's parts do not cover the model")
    with quiet_redistribute(), torch.no_grad():
        for name in names:
            full = None
            if name in local:
                value = local[name].detach()
                full = value.full_tensor() if isinstance(value, DTensor) else value
            if owner[name] != 0 and rank == owner[name]:
                assert full is not None  # the owner holds it
                dist.send(full.contiguous(), dst=0)
            if rank == 0:
                if owner[name] != 0:
                    full = torch.empty(shapes[name], dtype=dtype, device=parallel_model.device)
                    dist.recv(full, src=owner[name])
                assert full is not None  # rank 0 holds it or has just received it
                yield name, full
            del full


def save_weights(parallel_model, directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path | None:
    """Write the weights folder from rank 0 (a collective); returns the file or index path on rank 0."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    writer = ShardedWriter(directory, max_shard_size, _METADATA) if rank == 0 else None
    for name, tensor in gathered_tensors(parallel_model):
        assert writer is not None  # only rank 0 is handed tensors
        writer.add(name, tensor)
    if writer is None:
        return None
    (Path(directory) / CONFIG_FILE).write_text(json.dumps(asdict(parallel_model.model_parts[0].cfg), indent=2))
    return writer.close()


def write_weights(state: Mapping[str, torch.Tensor], cfg: ModelConfig, directory: Path,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """The weights folder format from a state dict (or any name -> tensor mapping), tied output dropped."""
    writer = ShardedWriter(directory, max_shard_size, _METADATA)
    for name in saved_names(cfg):
        writer.add(name, state[name])
    (Path(directory) / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2))
    return writer.close()


def open_weights(directory: Path) -> tuple[ModelConfig, SafetensorsFolder]:
    """(model config, lazy reader) of a weights folder, single-file or sharded."""
    from meshformer.config import build_section

    directory = Path(directory)
    if not has_safetensors(directory) or not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no {WEIGHTS_FILE} (or sharded index) + {CONFIG_FILE}; point at "
                                "a run's final/ folder or the output of `meshformer convert to-safetensors`")
    try:
        cfg = build_section(ModelConfig, json.loads((directory / CONFIG_FILE).read_text()), "model")
        return cfg, SafetensorsFolder(directory)
    except MeshformerError:  # already one line naming the file (e.g. an index naming files outside the folder)
        raise
    except (ValueError, SafetensorError) as err:  # JSON, config keys, safetensors header or index
        raise CorruptCheckpointError(f"{directory} is not a readable weights folder ({err})",
                                     "re-export it (`meshformer convert to-safetensors`) or use the run's final/ "
                                     "folder") from None


def read_weights(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(model config, full state dict with tied weights restored) of a weights folder: small models only."""
    cfg, folder = open_weights(directory)
    try:
        state = dict(folder.items())
    except SafetensorError as err:
        raise CorruptCheckpointError(f"{directory} is not a readable weights folder ({err})",
                                     "re-export it (`meshformer convert to-safetensors`) or use the run's final/ "
                                     "folder") from None
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return cfg, state


class TensorSource(Protocol):
    """What `load_into` reads from: a weights folder (`SafetensorsFolder`), or an HF folder under our names."""

    def __contains__(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...
    def get_slice(self, name: str) -> Any: ...  # indexable by a tuple of slices, reading only those


@torch.no_grad()
def load_into(parts: list[nn.Module], folder: TensorSource) -> None:
    """Fill (possibly sharded) model parts from a weights folder, reading only each parameter's local slice."""
    from meshformer.checkpointing.state import named_buffers, named_parameters

    for part in parts:
        for name, param in named_parameters([part]):
            if name not in folder:
                raise KeyError(f"the weights folder has no {name!r}; it was saved for a different model")
            _copy_local(param, folder, name)
        for name, buffer in named_buffers([part]):  # weights saved before a buffer was kept leave it as built
            if name in folder:
                buffer.copy_(folder.get(name))


def _copy_local(param: torch.Tensor, folder: TensorSource, name: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        param.copy_(folder.get(name))
        return
    local = param.to_local()
    if all(type(p) in (Shard, Replicate) for p in param.placements):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        local.copy_(folder.get_slice(name)[index])
    else:  # strided (FSDP x TP) shards: one whole tensor in flight, then this rank's part of it
        full = folder.get(name).to(local.device)
        local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local())


def load_weights(directory: Path) -> Transformer:
    """Rebuild a Transformer from a weights folder: built on meta, each tensor read straight into place."""
    from meshformer.parallel.materialize import materialize

    cfg, folder = open_weights(directory)
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize([model], torch.device("cpu"), init=False)
    load_into([model], folder)  # fp32, whatever dtype was saved, as load_state_dict would give
    return model
