"""What one rank holds: the real model built on the meta device and parallelised under a fake process group.

No memory is allocated and no other process exists: torch's fake process group answers every collective, so a
single process can play rank 0 of a 4096-rank world. The model goes through the trainer's own path (pipeline
split -> tensor parallel -> recompute -> FSDP, `meshformer.parallel.parallelize.parallelize_part`) and the shapes of the
local shards are read off the resulting DTensors. Rank 0 of every data/tensor-parallel group holds the largest
shard (FSDP pads dim 0 to a multiple of the group size and gives the remainder to the first ranks), so its
figures are the worst case; each distinct pipeline stage is built once.

Expert weights (MoE layers under `parallel.ep`) are split over the ep ranks first (whole experts, dim 0) and then
within their block's FSDP unit over the data-parallel ranks ep leaves (`dp_shard_mod_ep`; dim 1 when fewer local experts
than those ranks, `parallel/expert_parallel.py`); their all-gathered size is this ep rank's experts, not all of
them. Every other weight is sharded over dp_shard x cp as before.
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

from meshformer.config import Config, ModelConfig
from meshformer.model import Transformer
from meshformer.model.families import get_family_spec
from meshformer.model.moe import moe_layers
from meshformer.optim.muon import is_muon_parameter
from meshformer.parallel.fsdp import blocks_of
from meshformer.parallel.grad_norm import local_tensor
from meshformer.parallel.mesh import Meshes, build_mesh
from meshformer.parallel.parallelize import parallelize_part
from meshformer.parallel.pipeline.stages import StagePlacement, TransformerStage, stage_pieces, stage_placement
from meshformer.parallel.tensor_parallel import apply_tensor_parallel
from meshformer.parallel_dims import ParallelDims, expert_shard_dim, validate_parallel


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
    muon_numel: int = 0  # this rank's shards of Muon matrices (optim.name="muon": one momentum, not two moments)
    muon_gather: int = 0  # the largest Muon matrix (this rank's experts of a stacked one) gathered whole to step


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


def _sizes_by_rule(shape: tuple[int, ...], dims: ParallelDims, expert: bool) -> tuple[int, int]:
    """(the first rank's shard, the padded tensor FSDP all-gathers) of a tensor-parallel local `shape`, in elements,
    by FSDP2's rule. Expert weights: n_experts / ep whole experts, then dim 0 (or dim 1 when fewer local experts
    than ranks, as `expert_shard_placement` chooses) chunked over `dp_shard_mod_ep`."""
    numel = math.prod(shape)
    if not (expert and dims.ep_enabled):
        shard = _fsdp_shard(numel, shape[0] if shape else 1, dims.fsdp_shard)
        return shard, shard * dims.fsdp_shard
    local = (shape[0] // dims.ep, *shape[1:])
    shards = dims.dp_shard_mod_ep
    dim = expert_shard_dim(local[0], shards)
    shard = math.ceil(local[dim] / shards) * (math.prod(local) // local[dim])
    return shard, shard * shards


def _expert_params(parts: Sequence[nn.Module]) -> set[int]:
    return {id(p) for part in parts for _, layer in moe_layers(part) for p in layer.experts.parameters()}


def rank_shares(cfg: Config, world_size: int, *, apply_fsdp: bool = True,
                model: Transformer | None = None) -> tuple[ParallelDims, list[RankShare]]:
    """Parallelise the meta model for `cfg.parallel` at `world_size`; one `RankShare` per distinct pipeline rank.

    With `apply_fsdp=False` only tensor parallel runs for real and FSDP's dim-0 sharding is applied to the
    tensor-parallel local shapes arithmetically (the rule FSDP2 uses). Must run inside `fake_world(world_size)`.
    """
    dims = validate_parallel(cfg, world_size, "cpu")  # as the trainer will, train.compile included
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=False))  # nothing compiles on meta
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
    experts = _expert_params(parts) if dims.ep_enabled else set()

    def sizes(param: torch.Tensor) -> tuple[int, int]:
        """(this rank's shard, the padded unsharded tensor an FSDP all-gather returns), in elements."""
        local = local_tensor(param)
        if not fsdp_applied:  # tensor parallel only: experts still whole here (expert parallel runs with FSDP)
            return _sizes_by_rule(tuple(local.shape), dims, id(param) in experts)
        # the experts' FSDP unit gathers this ep rank's experts over the data-parallel ranks ep leaves
        return local.numel(), local.numel() * (dims.dp_shard_mod_ep if id(param) in experts else dims.fsdp_shard)

    in_block = {id(p) for part in parts for block in blocks_of(part) for p in block.parameters()}
    sharded = root = 0
    for param in _unique_params(parts):
        shard, unsharded = sizes(param)
        sharded += shard
        root += 0 if id(param) in in_block else unsharded
    block = max((sum(sizes(p)[1] for p in candidate.parameters()) for part in parts for candidate in blocks_of(part)),
                default=0)
    layers = tuple(index for part in parts for index, _ in part.spec.blocks(part))
    muon = {id(p): p for part in parts for n, p in part.named_parameters() if is_muon_parameter(n, p)}
    muon_numel = sum(sizes(p)[0] for p in muon.values())
    muon_gather = max((_muon_gather(p.numel(), id(p) in experts, dims) for p in muon.values()), default=0)
    return RankShare(rank, layers, len(parts), sharded, root, block, first, last, muon_numel, muon_gather)


def _muon_gather(global_numel: int, expert: bool, dims: ParallelDims) -> int:
    """Elements of one Muon parameter whole on a rank at the optimizer step: experts stay on their ep rank."""
    return global_numel // dims.ep if expert and dims.ep_enabled else global_numel


# Tensor-parallel local shape of each parameter, whether it is an expert weight and (a Muon matrix of a block) its
# whole size in elements, else 0, per model piece; blocks per stack and kinds, under "<stack>/<token mixer>/<channel
# mixer>".
Template = dict[str, list[tuple[tuple[int, ...], bool, int]]]


def _kinds(m: ModelConfig, index: int) -> tuple[str, str]:
    """The (token mixer, channel mixer) kinds of block `index` of a stack: blocks alike in both hold alike shapes."""
    return m.layer_type(index), m.mlp_type(index)


def _block_key(cfg: Config, stack: str, index: int) -> str:
    return "/".join((stack, *_kinds(cfg.model, index)))


def tp_template(cfg: Config, world_size: int, tp: int) -> Template:
    """Parameter shapes after the real tensor-parallel plan, read off a one-block-per-stack copy of the model for
    each pair of block kinds the model holds.

    Blocks of a stack with the same kinds are identical, so the layout search sizes any pipeline split from these
    builds per tp. Must run inside `fake_world(world_size)`.
    """
    m = cfg.model
    template: Template = {}
    spec = get_family_spec(m.family)
    variants = list(dict.fromkeys(_kinds(m, i) for stack in spec.stacks for i in range(stack.count(m))))
    for number, (token, channel) in enumerate(variants):
        suffix = f"/{token}/{channel}"
        small = dataclasses.replace(m, n_layers=1, n_encoder_layers=1, n_decoder_layers=1,  # whichever a stack reads
                                    layer_types=[token], mlp_types=[channel])
        model = meta_model(dataclasses.replace(cfg, model=small))
        if tp > 1:
            parallel = dataclasses.replace(cfg.parallel, pp=1, tp=tp, dp_replicate=1, dp_shard=-1, ep=1, cp=1)
            dims = ParallelDims.from_config(parallel, world_size)
            apply_tensor_parallel(model, build_mesh(dims, "cpu").tp)
        experts_of = _expert_params([model])
        stacks = model.spec.layer_offsets(m)
        for name, module in model.named_children():
            muon_name = "x_layers.0.{}"
            if name in stacks:
                assert isinstance(module, nn.ModuleDict)  # a stack of blocks "0", "1", ...
                module, name = module["0"], name + suffix
            elif name == "mtp_layers":  # multi-token prediction: its blocks have the last block's kinds
                if (token, channel) != _kinds(m, m.n_layers - 1):
                    continue
                muon_name = "mtp_layers.{}"
            elif number:
                continue  # the rest of the model is the first build's
            params = [(p, n) for n, p in module.named_parameters()]
            if name == "output" and m.tie_embeddings:
                params = [(p, n) for p, n in params if n != "weight"]  # the embedding's; counted with it or copied
            in_block = name.split("/")[0] in stacks or name == "mtp_layers"
            template[name] = [(tuple(local_tensor(p).shape), id(p) in experts_of,
                               p.numel() if in_block and is_muon_parameter(muon_name.format(n), p) else 0)
                              for p, n in params]
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

    def sizes(key: str) -> tuple[int, int]:
        """(shard, all-gathered) elements of one piece (or block) on the first rank."""
        both = [_sizes_by_rule(shape, dims, expert) for shape, expert, _ in template[key]]
        return sum(x for x, _ in both), sum(x for _, x in both)

    def muon_sizes(key: str) -> tuple[int, int]:
        """(Muon shards, largest Muon parameter whole) elements of one block on the first rank."""
        muon = [(shape, expert, whole) for shape, expert, whole in template[key] if whole]
        return (sum(_sizes_by_rule(shape, dims, expert)[0] for shape, expert, _ in muon),
                max((_muon_gather(whole, expert, dims) for _, expert, whole in muon), default=0))

    for (_sizes, first, last), ranks in _rank_layouts(placement, dims.pp).items():
        ids = placement.ids_for_rank(ranks[0])
        sharded = root = block = muon_numel = muon_gather = 0
        layers: list[int] = []
        for sid in ids:
            pieces = {k: v for k, v in stage_pieces(model, placement.spans[sid]).items() if v is not None}
            if cfg.model.tie_embeddings and "output" in pieces and "tok_embeddings" not in pieces:
                pieces["tied_output"] = pieces["output"]  # this stage holds its own copy of the table
            for name, module in pieces.items():
                if name in offsets and isinstance(module, nn.ModuleDict):
                    for key in module.keys():
                        shard, gathered = sizes(_block_key(cfg, name, int(key)))
                        muon_shard, muon_whole = muon_sizes(_block_key(cfg, name, int(key)))
                        muon_numel += muon_shard
                        muon_gather = max(muon_gather, muon_whole)
                        sharded += shard
                        block = max(block, gathered)
                        layers.append(offsets[name] + int(key))
                else:
                    shard, gathered = sizes(name)
                    sharded += shard
                    root += gathered
                    muon_shard, muon_whole = muon_sizes(name)  # the multi-token prediction modules' matrices
                    muon_numel += muon_shard
                    muon_gather = max(muon_gather, muon_whole)
        shares.append(RankShare(ranks[0], tuple(sorted(layers)), len(ids), sharded, root, block, first, last,
                                muon_numel, muon_gather))
    return dims, shares
