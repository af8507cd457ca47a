"""The planner's two questions: what does this layout need per rank, and which layouts fit a device?

Every answer comes from the parallelised model on meta and the peak walk (`memory.rank_memory`). The reported
layout goes through the trainer's whole path (`shard.rank_shares`); the search applies the real tensor-parallel
plan once per tp to one block per stack (`shard.tp_template`) and sizes each pipeline split and FSDP size from
it (`shard.template_shares`); a test holds the two against each other.

Mixture-of-experts models are also searched over `parallel.ep` (every divisor of n_experts the rules of
`parallel_dims.check_expert_parallel` allow: a multiple of cp x tp taken from the data-parallel ranks, leaving
FSDP an even split of the experts' shard dim); expert activations are planned at `moe_imbalance` times the
balanced load (`activations.moe_rows`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from meshformer.config import Config, ConfigError, Recompute
from meshformer.model.families import get_family_spec
from meshformer.parallel_dims import (
    ParallelDims,
    check_compiled_recompute,
    check_context_parallel,
    check_expert_parallel,
)
from meshformer.planner.activations import MOE_IMBALANCE
from meshformer.planner.memory import RankMemory, rank_memory, usable_bytes
from meshformer.planner.shard import fake_world, meta_model, rank_shares, template_shares, tp_template

RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
# FSDP shard groups larger than this are sized by FSDP2's dim-0 rule (`shard._fsdp_shard`), not by fully_shard:
# torch builds one meta chunk per shard and parameter, minutes at 100k ranks.
REAL_FSDP_SHARDS = 4096
TP_SIZES = (1, 2, 4, 8)  # tensor parallel stays inside one 8-GPU node
CP_SIZES = (1, 2, 4, 8, 16, 32, 64)  # context parallel (not encoder-decoder): Llama 3 trained 128k-token sequences at
# cp 16; a million-token sequence needs more ranks to hold its pieces


@dataclass
class LayoutMemory:
    pp: int
    tp: int
    dp_shard: int
    dp_replicate: int
    recompute: str
    ranks: list[RankMemory]
    cp: int = 1
    ep: int = 1

    @property
    def peak(self) -> float:
        return max(rank.peak for rank in self.ranks)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda rank: rank.peak)


def with_layout(cfg: Config, world_size: int, pp: int, tp: int, recompute: Recompute, cp: int | None = None,
                ep: int | None = None) -> Config:
    """`cfg` with another layout (cp, ep None: the configured ones) and FSDP over the remaining ranks, same
    micro-batch size.

    A pipeline gets pp micro-batches (the 1F1B minimum) of the config's micro-batch size; without data
    parallelism FSDP's mixed precision becomes bf16 autocast (same activations, fp32 weights).
    """
    p, data, train = cfg.parallel, cfg.data, cfg.train
    micro = max(1, data.batch_size // (p.pp_microbatches or p.pp)) if p.pp > 1 else data.batch_size
    parallel = dataclasses.replace(p, pp=pp, tp=tp, dp_shard=-1, dp_replicate=1, recompute=recompute,
                                   pp_split_points=p.pp_split_points if pp == p.pp else [],
                                   cp=p.cp if cp is None else cp, ep=p.ep if ep is None else ep)
    if pp > 1:
        schedule = p.pp_schedule if p.pp > 1 else "1f1b"
        parallel = dataclasses.replace(parallel, pp_schedule=schedule, pp_microbatches=pp)
    data = dataclasses.replace(data, batch_size=micro * (pp if pp > 1 else 1))
    if world_size // (pp * tp) == 1 and "bf16" in (p.mixed_precision_param, p.mixed_precision_reduce):
        parallel = dataclasses.replace(parallel, mixed_precision_param="fp32", mixed_precision_reduce="fp32")
        train = dataclasses.replace(train, dtype="bf16")
    return dataclasses.replace(cfg, parallel=parallel, data=data, train=train)


def plan_layout(cfg: Config, world_size: int, moe_imbalance: float = MOE_IMBALANCE) -> LayoutMemory:
    """Memory per pipeline rank of `cfg`'s own layout, through the real TP + FSDP path on meta (FSDP by its rule
    beyond REAL_FSDP_SHARDS). `moe_imbalance`: see `activations.moe_rows`."""
    real_fsdp = ParallelDims.from_config(cfg.parallel, world_size).fsdp_shard <= REAL_FSDP_SHARDS
    with fake_world(world_size):
        dims, shares = rank_shares(cfg, world_size, apply_fsdp=real_fsdp)
    return _layout(cfg, dims, [rank_memory(cfg, dims, share, moe_imbalance) for share in shares])


def _layout(cfg: Config, dims: ParallelDims, ranks: list[RankMemory]) -> LayoutMemory:
    return LayoutMemory(dims.pp, dims.tp, dims.dp_shard, dims.dp_replicate, cfg.parallel.recompute, ranks, dims.cp,
                        dims.ep)


def _divisors_pow2(n: int, limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit and n % k == 0:
        out.append(k)
        k *= 2
    return out


def _context_layouts(cfg: Config, world_size: int, pp: int, tp: int) -> list[tuple[int, ParallelDims]]:
    """(cp, dimensions) for every cp the ranks left after pp x tp and the layout's context-parallel rules allow."""
    layouts = []
    for cp in CP_SIZES:
        if (world_size // (pp * tp)) % cp:
            continue
        dims = ParallelDims.from_config(with_layout(cfg, world_size, pp, tp, "none", cp).parallel, world_size)
        try:
            check_context_parallel(cfg, dims)
        except ConfigError:
            continue
        layouts.append((cp, dims))
    return layouts


def _expert_choices(cfg: Config, world_size: int, pp: int, tp: int, cp: int, recompute: Recompute) -> list[int]:
    """The ep values the expert-parallel rules allow for this layout ([1] for a dense model)."""
    n = cfg.model.moe.n_experts
    if not n:
        return [1]
    # ep divides n_experts and the ranks it is taken from (which divide the world), so only divisors of the gcd
    # qualify: a config with 1e8 experts costs a handful of candidates, not 1e8.
    common = math.gcd(n, world_size)
    choices = []
    for ep in (d for d in range(1, common + 1) if common % d == 0):
        layout = with_layout(cfg, world_size, pp, tp, recompute, cp, ep)
        try:
            check_expert_parallel(layout, ParallelDims.from_config(layout.parallel, world_size))
        except ConfigError:
            continue
        choices.append(ep)
    return choices


def search_layouts(cfg: Config, world_size: int, device: str, moe_imbalance: float = MOE_IMBALANCE
                   ) -> list[LayoutMemory]:
    """Every (pp, tp, cp, ep, recompute) with FSDP over the remaining ranks, smallest first: least model and sequence
    parallelism (tp x pp x cp), then least recomputation, then fewest expert-parallel ranks (all-to-all peers), then
    lowest peak. Layouts the config cannot run are skipped. FSDP shards over dp_shard x cp and the experts over ep x
    the data-parallel ranks ep leaves, so each (pp, tp, ep) split's parameter shards serve every cp."""
    layers = get_family_spec(cfg.model.family).total_layers(cfg.model)
    results: list[LayoutMemory] = []
    with fake_world(world_size):
        model = meta_model(cfg)
        for tp in TP_SIZES:
            if world_size % tp:
                continue
            try:
                template = tp_template(with_layout(cfg, world_size, 1, tp, "none", cp=1), world_size, tp)
            except ConfigError:
                continue
            for pp in _divisors_pow2(world_size // tp, layers):
                shares = {}
                for ep in _expert_choices(cfg, world_size, pp, tp, 1, "none"):
                    base = with_layout(cfg, world_size, pp, tp, "none", cp=1, ep=ep)  # the same for every cp
                    try:
                        shares[ep] = template_shares(base, world_size, model, template)[1]
                    except (ConfigError, ValueError):
                        continue
                for cp, _ in _context_layouts(cfg, world_size, pp, tp):
                    for mode in RECOMPUTE_MODES:
                        for ep in _expert_choices(cfg, world_size, pp, tp, cp, mode):
                            if ep not in shares:
                                continue
                            layout_cfg = with_layout(cfg, world_size, pp, tp, mode, cp, ep)
                            dims = ParallelDims.from_config(layout_cfg.parallel, world_size)
                            try:  # e.g. compiled full recomputation of tensor-parallel weights
                                check_compiled_recompute(layout_cfg, dims)
                            except ConfigError:
                                continue
                            results.append(_layout(layout_cfg, dims, [rank_memory(layout_cfg, dims, s, moe_imbalance)
                                                                      for s in shares[ep]]))
    budget = usable_bytes(device)
    results.sort(key=lambda r: (r.peak > budget, r.tp * r.pp * r.cp, RECOMPUTE_MODES.index(r.recompute), r.ep, r.peak))
    return results
