"""What one rank holds: the real model built on the meta device and parallelised under a fake process group.

No memory is allocated and no other process exists: torch's fake process group answers every collective, so a
single process can play rank 0 of a 4096-rank world. The model goes through the trainer's own path (pipeline
split -> tensor parallel -> recompute -> FSDP, `meshformer.parallel.parallelize.parallelize_part`) and the shapes of the
local shards are read off the resulting DTensors. Rank 0 of every data/tensor-parallel group holds the largest
shard (FSDP pads dim 0 to a multiple of the group size and gives the remainder to the first ranks), so its
figures are the worst case; each distinct pipeline stage is built once.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from meshformer.config import Config
from meshformer.model import Transformer
from meshformer.parallel.fsdp import blocks_of
from meshformer.parallel.grad_norm import local_tensor
from meshformer.parallel.mesh import Meshes, build_mesh
from meshformer.parallel.parallelize import parallelize_part
from meshformer.parallel.pipeline.stages import StagePlacement, TransformerStage, stage_pieces, stage_placement
from meshformer.parallel.tensor_parallel import apply_tensor_parallel
from meshformer.parallel_dims import ParallelDims, validate_parallel


@dataclass(frozen=True)
class RankShare:
    """One pipeline rank's part of the model (numbers of elements; parameters are fp32 masters)."""

    pp_rank: int
    layers: tuple[int, ...]  # global block indices held (encoder blocks first)
    chunks: int  # pipeline stages on this rank (interleaved / V schedules hold several)
    sharded_numel: int  # this rank's parameter shards (after TP and FSDP)
    root_numel: int  # FSDP root unit (embeddings, norms, head) unsharded, tensor-parallel local
    block_numel: int  # the largest FSDP block unit unsharded, tensor-parallel local
    first: bool  # embeds the input
    last: bool  # computes logits and the loss


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake default process group of `world_size` ranks for the duration of the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("the memory planner needs a process without a process group (it fakes one)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def meta_model(cfg: Config) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg.model)


def _unique_params(parts: Sequence[nn.Module]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for part in parts:
        for param in part.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def _rank_layouts(placement: StagePlacement, pp: int) -> dict[tuple, list[int]]:
    """Pipeline ranks grouped by what they hold: (stage ids' layer spans, first, last) -> ranks."""
    spans = placement.spans
    kinds: dict[tuple, list[int]] = {}
    for rank in range(pp):
        own = [spans[s] for s in placement.ids_for_rank(rank)]
        key = (tuple(s.stop - s.start for s in own), any(s.index == 0 for s in own),
               any(s.index == len(spans) - 1 for s in own))
        kinds.setdefault(key, []).append(rank)
    return kinds


def _parts_for_rank(model: Transformer, placement: StagePlacement, pp: int, rank: int) -> list[Transformer]:
    if pp == 1:
        return [copy.deepcopy(model)]
    return [TransformerStage(model, placement.spans[s]) for s in placement.ids_for_rank(rank)]


def _fsdp_shard(numel_tp: int, dim0: int, dp_shard: int) -> int:
    """Elements FSDP2 leaves on the first rank: dim 0 chunked into ceil(dim0 / dp_shard) rows."""
    if dp_shard == 1 or dim0 == 0:
        return numel_tp
    return math.ceil(dim0 / dp_shard) * (numel_tp // dim0)


def rank_shares(cfg: Config, world_size: int, *, apply_fsdp: bool = True,
                model: Transformer | None = None) -> tuple[ParallelDims, list[RankShare]]:
    """Parallelise the meta model for `cfg.parallel` at `world_size`; one `RankShare` per distinct pipeline rank.

    With `apply_fsdp=False` only tensor parallel runs for real and FSDP's dim-0 sharding is applied to the
    tensor-parallel local shapes arithmetically (the rule FSDP2 uses). Must run inside `fake_world(world_size)`.
    """
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))
    dims = validate_parallel(cfg, world_size, "cpu")
    meshes: Meshes = build_mesh(dims, "cpu")
    model = model if model is not None else meta_model(cfg)
    placement = stage_placement(cfg, dims)
    shares = []
    for (_sizes, first, last), ranks in _rank_layouts(placement, dims.pp).items():
        parts = _parts_for_rank(model, placement, dims.pp, ranks[0])
        for part in parts:
            if apply_fsdp:
                parallelize_part(part, cfg, dims, meshes, torch.device("cpu"))
            elif dims.tp_enabled:
                apply_tensor_parallel(part, meshes.tp)
        shares.append(_measure(parts, dims, ranks[0], apply_fsdp, first, last))
    return dims, shares


def _measure(parts: list[Transformer], dims: ParallelDims, rank: int, fsdp_applied: bool, first: bool,
             last: bool) -> RankShare:
    def sizes(param: torch.Tensor) -> tuple[int, int]:
        """(this rank's shard, the padded unsharded tensor an FSDP all-gather returns), in elements."""
        local = local_tensor(param)
        if not fsdp_applied:
            shard = _fsdp_shard(local.numel(), local.shape[0] if local.dim() else 1, dims.fsdp_shard)
            return shard, shard * dims.fsdp_shard
        return local.numel(), local.numel() * dims.fsdp_shard

    in_block = {id(p) for part in parts for block in blocks_of(part) for p in block.parameters()}
    sharded = root = 0
    for param in _unique_params(parts):
        shard, unsharded = sizes(param)
        sharded += shard
        root += 0 if id(param) in in_block else unsharded
    block = max((sum(sizes(p)[1] for p in candidate.parameters()) for part in parts for candidate in blocks_of(part)),
                default=0)
    layers = tuple(index for part in parts for index, _ in part.spec.blocks(part))
    return RankShare(rank, layers, len(parts), sharded, root, block, first, last)


# Tensor-parallel local (dim 0, numel) of each parameter, per model piece; blocks per stack.
Template = dict[str, list[tuple[int, int]]]


def tp_template(cfg: Config, world_size: int, tp: int) -> Template:
    """Parameter shapes after the real tensor-parallel plan, read off a one-block-per-stack copy of the model.

    Blocks of a stack are identical, so the layout search sizes any pipeline split from this one build per tp.
    Must run inside `fake_world(world_size)`.
    """
    m = cfg.model
    small = dataclasses.replace(m, n_layers=1, n_encoder_layers=1, n_decoder_layers=1)  # whichever a stack reads
    model = meta_model(dataclasses.replace(cfg, model=small))
    if tp > 1:
        parallel = dataclasses.replace(cfg.parallel, pp=1, tp=tp, dp_replicate=1, dp_shard=-1)
        dims = ParallelDims.from_config(parallel, world_size)
        apply_tensor_parallel(model, build_mesh(dims, "cpu").tp)
    template: Template = {}
    stacks = model.spec.layer_offsets(m)
    for name, module in model.named_children():
        if name in stacks:
            assert isinstance(module, nn.ModuleDict)  # a stack of blocks "0", "1", ...
            module = module["0"]
        params = [(p, n) for n, p in module.named_parameters()]
        if name == "output" and m.tie_embeddings:
            params = [(p, n) for p, n in params if n != "weight"]  # the embedding's; counted with it or copied
        template[name] = [(local_tensor(p).shape[0] if p.dim() else 1, local_tensor(p).numel()) for p, _ in params]
    if m.tie_embeddings:
        template["tied_output"] = template["tok_embeddings"]
    return template


def template_shares(cfg: Config, world_size: int, model: Transformer, template: Template
                    ) -> tuple[ParallelDims, list[RankShare]]:
    """`rank_shares` for the search: pipeline split by `stage_pieces`, sizes from `tp_template`, FSDP by rule."""
    dims = validate_parallel(cfg, world_size, "cpu")
    placement = stage_placement(cfg, dims)
    shares = []
    offsets = model.spec.layer_offsets(cfg.model)
    for (_sizes, first, last), ranks in _rank_layouts(placement, dims.pp).items():
        ids = placement.ids_for_rank(ranks[0])
        sharded = root = block = 0
        layers: list[int] = []
        for sid in ids:
            pieces = {k: v for k, v in stage_pieces(model, placement.spans[sid]).items() if v is not None}
            if cfg.model.tie_embeddings and "output" in pieces and "tok_embeddings" not in pieces:
                pieces["tied_output"] = pieces["output"]  # this stage holds its own copy of the table
            for name, module in pieces.items():
                keys = list(module.keys()) if name in offsets and isinstance(module, nn.ModuleDict) else []
                blocks = len(keys)
                sizes = [(_fsdp_shard(numel, dim0, dims.fsdp_shard), dims.fsdp_shard) for dim0, numel in template[name]]
                shard = sum(x for x, _ in sizes)
                padded = sum(x * dp for x, dp in sizes)
                sharded += shard * max(blocks, 1)
                if blocks:
                    block = max(block, padded)
                    layers += [offsets[name] + int(key) for key in keys]
                else:
                    root += padded
        shares.append(RankShare(ranks[0], tuple(sorted(layers)), len(ids), sharded, root, block, first, last))
    return dims, shares
