"""Final model weights as safetensors (one file, or HF-style shards + index) plus the model config.

Saving streams: every tensor is gathered on its own (`full_tensor()`, a collective over the ranks that hold
it), sent to rank 0 by the lowest rank holding it, or (FSDP row shards) sent block by block, and rank 0 writes
it to disk at once (headers first): no process holds more than one tensor beyond its own shards, whatever the
file size. The folder carries the
model's tokenizer (tokenizer.json, its fingerprint in the safetensors metadata); model_config.json is written
last. Loading reads tensor by tensor (or only this rank's slice of each), never a whole state dict.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from meshformer.checkpointing import directory as directory_layout
from meshformer.checkpointing.checkpoint_errors import CorruptCheckpointError
from meshformer.checkpointing.manifest import write_json_atomic
from meshformer.checkpointing.sharded_safetensors import (
    DEFAULT_MAX_SHARD_SIZE,
    SINGLE_FILE,
    SafetensorsFolder,
    ShardedWriter,
    has_safetensors,
)
from meshformer.config import ModelConfig
from meshformer.data import Tokenizer
from meshformer.data.tokenizer import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from meshformer.errors import MeshformerError
from meshformer.model import Transformer

WEIGHTS_FILE = SINGLE_FILE
CONFIG_FILE = "model_config.json"
TOKENIZER_FILE = directory_layout.TOKENIZER_FILE  # the run's tokenizer, beside the weights it was trained with
TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"  # safetensors metadata: `Tokenizer.fingerprint` of that tokenizer
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


@dataclass
class GatherPlan:
    """Who holds what, the same on every rank (a collective builds it)."""

    local: dict[str, torch.Tensor]  # this rank's tensors (DTensors or plain)
    owner: dict[str, int]  # the lowest rank holding each tensor
    layout: dict[str, torch.Tensor]  # name -> meta tensor of the whole tensor, in saving order
    # name -> (rank, local shape) of each row block, in order, for tensors rank 0 holds as a row shard on a 1-D
    # mesh (FSDP): rank 0 writes the blocks as they arrive, the tensor is never whole anywhere
    row_blocks: dict[str, list[tuple[int, tuple[int, ...]]]]


def _row_shard_ranks(value: torch.Tensor) -> list[int] | None:
    """The ranks holding `value`'s row blocks in order, if it is sharded by rows over a 1-D mesh."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(value, DTensor) and value.device_mesh.ndim == 1 and tuple(value.placements) == (Shard(0),):
        return value.device_mesh.mesh.flatten().tolist()
    return None


def gather_plan(parallel_model) -> GatherPlan:
    """The plan of a final save: a collective every rank calls."""
    from meshformer.checkpointing.state import named_buffers, named_parameters
    from meshformer.parallel.grad_norm import local_tensor

    local = dict(named_parameters(parallel_model.model_parts)) | dict(named_buffers(parallel_model.model_parts))
    cfg = parallel_model.model_parts[0].cfg
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}  # of tensors other ranks send
    mine = {name: (t.dtype, _row_shard_ranks(t), tuple(local_tensor(t).shape))
            for name, t in local.items()}
    held: list[dict | None] = [mine]
    if dist.is_initialized():
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, mine)
    owner: dict[str, int] = {}
    dtypes: dict[str, torch.dtype] = {}
    for r, report in enumerate(held):
        for key, (dtype, _, _) in sorted((report or {}).items()):
            owner.setdefault(key, r)
            dtypes.setdefault(key, dtype)
    names = saved_names(cfg, shapes)
    if missing := [n for n in names if n not in owner]:
        raise RuntimeError(f"no rank holds {missing[:5]}: the parallel model's parts do not cover the model")
    layout = {name: torch.empty(shapes[name], dtype=dtypes[name], device="meta") for name in names}
    rank0 = held[0] or {}
    row_blocks = {name: [(r, (held[r] or {})[name][2]) for r in rank0[name][1]]
                  for name in names if name in rank0 and rank0[name][1] is not None}
    return GatherPlan(local, owner, layout, row_blocks)


def gathered_pieces(parallel_model, plan: GatherPlan | None = None, between: Callable[[], None] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, piece) on rank 0, in model order: a tensor's pieces, in order along dim 0, make it whole. A
    collective every rank iterates; `between` runs on every rank before each tensor (a training run's stop check,
    which raises to leave the save on every rank alike).

    A row-sharded (FSDP) tensor comes as its blocks, each sent by its rank: no rank ever holds it whole. Any other
    is gathered by the ranks holding it and sent once, by the lowest of them: pipeline stages contribute their
    own layers, data- and tensor-parallel replicas send nothing twice.
    """
    from torch.distributed.tensor import DTensor

    plan = plan or gather_plan(parallel_model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    with quiet_redistribute(), torch.no_grad():
        for name, template in plan.layout.items():
            if between is not None:
                between()
            if name in plan.row_blocks:
                yield from _row_blocks(name, plan, rank, parallel_model.device)
                continue
            full = None
            if name in plan.local:
                value = plan.local[name].detach()
                full = value.full_tensor() if isinstance(value, DTensor) else value
            if plan.owner[name] != 0 and rank == plan.owner[name]:
                assert full is not None  # the owner holds it
                dist.send(full.contiguous(), dst=0)
            if rank == 0:
                if plan.owner[name] != 0:
                    full = torch.empty(template.shape, dtype=template.dtype, device=parallel_model.device)
                    dist.recv(full, src=plan.owner[name])
                assert full is not None  # rank 0 holds it or has just received it
                yield name, full
            del full


def _row_blocks(name: str, plan: GatherPlan, rank: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0 yields its own block and receives the others' in turn, one at a time; empty blocks never travel."""
    from meshformer.parallel.grad_norm import local_tensor

    blocks = [(r, shape) for r, shape in plan.row_blocks[name] if math.prod(shape) > 0]
    if rank == 0 and not blocks:  # an empty tensor: one empty piece says it is written
        yield name, torch.empty(plan.layout[name].shape, dtype=plan.layout[name].dtype)
    for source, shape in blocks:
        if rank == 0:
            if source == 0:
                yield name, local_tensor(plan.local[name])
            else:
                block = torch.empty(shape, dtype=plan.layout[name].dtype, device=device)
                dist.recv(block, src=source)
                yield name, block
                del block
        elif rank == source:
            dist.send(local_tensor(plan.local[name]).contiguous(), dst=0)


def save_weights(parallel_model, directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                 tokenizer: Tokenizer | None = None, between: Callable[[], None] | None = None) -> Path | None:
    """Write the weights folder from rank 0 (a collective), each tensor streamed to disk as it is gathered;
    returns the file or index path on rank 0. `between`: as for `gathered_pieces`."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    plan = gather_plan(parallel_model)
    writer = _writer(directory, plan.layout, max_shard_size, tokenizer) if rank == 0 else None
    for name, piece in gathered_pieces(parallel_model, plan, between):
        assert writer is not None  # only rank 0 is handed pieces
        writer.add_part(name, piece)
        del piece  # written: the next one may take its memory
    if writer is None:
        return None
    return _finish(writer, parallel_model.model_parts[0].cfg, tokenizer)


def write_weights(state: Mapping[str, torch.Tensor], cfg: ModelConfig, directory: Path,
                  max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, tokenizer: Tokenizer | None = None) -> Path:
    """The weights folder format from a state dict (or any name -> tensor mapping, e.g. read lazily: one tensor
    in memory at a time), tied output dropped; `tokenizer`, the model's, travels with it."""
    names = saved_names(cfg)
    layout = {name: _template(state, name) for name in names}
    writer = _writer(directory, layout, max_shard_size, tokenizer)
    for name in names:
        writer.add(name, state[name])
    return _finish(writer, cfg, tokenizer)


def _template(state: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Shape and dtype of `state[name]` without reading it where `state` can tell (a LazyState)."""
    meta = getattr(state, "meta", None)
    return meta(name) if callable(meta) else state[name]


def _writer(directory: Path, layout: dict[str, torch.Tensor], max_shard_size: int | str,
            tokenizer: Tokenizer | None) -> ShardedWriter:
    """A writer into `directory`, whose older config and tokenizer go first: until `_finish`, the folder holds no
    model_config.json, and never one (or a tokenizer) beside weights it does not describe."""
    for stale in (CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        (Path(directory) / stale).unlink(missing_ok=True)
    metadata = {**_METADATA, **({TOKENIZER_FINGERPRINT: tokenizer.fingerprint} if tokenizer is not None else {})}
    return ShardedWriter(directory, layout, max_shard_size, metadata)


def _finish(writer: ShardedWriter, cfg: ModelConfig, tokenizer: Tokenizer | None) -> Path:
    """Close the files, then the tokenizer, then model_config.json last: a folder without it is unfinished, and
    every reader refuses it."""
    path = writer.close()
    directory = Path(writer.directory)
    if tokenizer is not None:
        tokenizer.save(directory / TOKENIZER_FILE)
    write_json_atomic(directory / CONFIG_FILE, asdict(cfg))
    return path


def open_weights(directory: Path) -> tuple[ModelConfig, SafetensorsFolder]:
    """(model config, lazy reader) of a weights folder, single-file or sharded."""
    from meshformer.config.migrate import model_from_dict

    directory = Path(directory)
    if not has_safetensors(directory) or not (directory / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no {WEIGHTS_FILE} (or sharded index) + {CONFIG_FILE}; point at "
                                "a run's final/ folder or the output of `meshformer convert to-safetensors`")
    try:
        cfg = model_from_dict(json.loads((directory / CONFIG_FILE).read_text()), str(directory / CONFIG_FILE))
        return cfg, SafetensorsFolder(directory)
    except MeshformerError:  # already one line naming the file (e.g. an index naming files outside the folder)
        raise
    except (ValueError, SafetensorError) as err:  # JSON, config keys, safetensors header or index
        raise CorruptCheckpointError(f"{directory} is not a readable weights folder ({err})",
                                     "re-export it (`meshformer convert to-safetensors`) or use the run's final/ "
                                     "folder") from None


def weights_tokenizer(directory: Path, spec: str | None = None, option: str = "--tokenizer") -> Tokenizer:
    """The tokenizer the weights in `directory` were trained with: the folder's own tokenizer.json, or `spec`
    (e.g. a --tokenizer option) if it is the same tokenizer. A tokenizer whose fingerprint differs from the one
    saved with the weights is refused, whatever its size: decoding with it gives wrong text, silently."""
    from meshformer.data import load_tokenizer
    from meshformer.data.tokenizer import TokenizerError, check_vocab

    directory = Path(directory)
    cfg, folder = open_weights(directory)
    own = directory / TOKENIZER_FILE
    if spec is None and not own.is_file():
        raise TokenizerError(f"{directory} carries no {TOKENIZER_FILE} (weights written before tokenizers travelled "
                             "with them, or copied without it)", f"pass {option} with the tokenizer the model was "
                             "trained with (its data.tokenizer)")
    tokenizer = load_tokenizer(str(directory) if spec is None else spec)
    refuse_other_tokenizer(tokenizer, folder.metadata.get(TOKENIZER_FINGERPRINT), directory, spec, option)
    check_vocab(tokenizer, cfg.vocab_size, option)
    return tokenizer


def refuse_other_tokenizer(tokenizer: Tokenizer, recorded: str | None, directory: Path, spec: str | None,
                           option: str) -> None:
    """One line naming both when `tokenizer` is not the one (`recorded` fingerprint) saved in `directory`."""
    from meshformer.data.tokenizer import TokenizerError

    if recorded and tokenizer.fingerprint != recorded:
        own = Path(directory) / TOKENIZER_FILE
        whose = f"{option} {spec!r}" if spec is not None else str(own)
        fix = (f"set {option} to the tokenizer the model was trained with ({own})" if spec is not None
               else f"restore {own} from the run's final/ folder")
        raise TokenizerError(f"{whose} (fingerprint {tokenizer.fingerprint[:12]}) is not the tokenizer the weights in "
                             f"{directory} were trained with (fingerprint {recorded[:12]})", fix)


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


def missing_tensors_error(source: Path | str, missing: list[str]) -> CorruptCheckpointError:
    """The one line for a weights folder (`source`: its file or index) lacking tensors its model config needs."""
    more = f" (nor {len(missing) - 1} more)" if missing[1:] else ""
    return CorruptCheckpointError(f"{source} has no tensor {missing[0]!r}{more}, which the model of the {CONFIG_FILE} "
                                  "beside it needs", f"re-export the folder, or put the {CONFIG_FILE} that belongs to "
                                  "these weights beside them")


class TensorSource(Protocol):
    """What `load_into` reads from: a weights folder (`SafetensorsFolder`), or an HF folder under our names."""

    def __contains__(self, name: str) -> bool: ...
    def get(self, name: str) -> torch.Tensor: ...
    def get_slice(self, name: str) -> Any: ...  # indexable by a tuple of slices, reading only those


@torch.no_grad()
def load_into(parts: list[nn.Module], folder: TensorSource, between: Callable[[], None] | None = None) -> None:
    """Fill (possibly sharded) model parts from a weights folder, reading only each parameter's local slice;
    `between` runs after each parameter (a training run's stop check, which raises to leave the load)."""
    from meshformer.checkpointing.state import named_buffers, named_parameters

    if missing := [name for name, _ in named_parameters(parts) if name not in folder]:
        raise missing_tensors_error(getattr(folder, "source", "the weights folder"), missing)
    for part in parts:
        for name, param in named_parameters([part]):
            _copy_local(param, folder, name)
            if between is not None:
                between()
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


def load_for_inference(directory: Path, tokenizer: str | None = None, option: str = "--tokenizer"
                       ) -> tuple[Transformer, Tokenizer]:
    """A weights folder (a run's `final/`, an export) as (model in eval mode on the CPU in fp32, the tokenizer it was
    trained with): what `generate`, `attention-map` and `meshformer.load` start from. `tokenizer` replaces the
    folder's own only if it is the same tokenizer (`option` is the name a refusal gives it)."""
    checked = weights_tokenizer(directory, tokenizer, option)  # first: a wrong tokenizer stops before the read
    return load_weights(directory).eval(), checked

