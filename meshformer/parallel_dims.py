"""The parallel layout of a run: its dimensions (`ParallelDims`, pure arithmetic on the config and the world size)
and every check of it against the model, the data and the device, run before any process group or model exists.

Every message names the config key and the fix, so a bad launch fails in seconds on every rank with the
same explanation instead of hanging in a collective or failing deep inside DTensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from meshformer.config import Config, ConfigError, ParallelConfig
from meshformer.model.components import model_kinds
from meshformer.model.families import get_family_spec
from meshformer.model.moe import expert_shapes

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
ZERO_BUBBLE = ("interleaved_zb", "zbv")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    world_size: int
    ep: int = 1  # expert parallel: taken from dp_shard x cp x tp, not a dimension of its own in the product

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Resolve dp_shard = -1 ("the rest of the world") and check the product against the world size."""
        for key in ("pp", "dp_replicate", "cp", "tp", "ep"):
            if getattr(cfg, key) < 1:
                raise ConfigError(f"parallel.{key} must be >= 1, got {getattr(cfg, key)}")
        if cfg.dp_shard == 0 or cfg.dp_shard < -1:
            raise ConfigError(f"parallel.dp_shard must be >= 1 or -1 (the rest of the world), got {cfg.dp_shard}")
        others = cfg.pp * cfg.dp_replicate * cfg.cp * cfg.tp
        dp_shard = cfg.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ConfigError(
                    f"parallel.pp={cfg.pp} x dp_replicate={cfg.dp_replicate} x cp={cfg.cp} x tp={cfg.tp} = {others} "
                    f"does not divide the world size {world_size}; choose dimensions whose product divides it"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ConfigError(
                f"mesh pp={cfg.pp} x dp_replicate={cfg.dp_replicate} x dp_shard={dp_shard} x cp={cfg.cp} x "
                f"tp={cfg.tp} = {product} processes, but the world has {world_size}; make the product equal the "
                "number of processes (parallel.dp_shard=-1 takes whatever the other dimensions leave)"
            )
        return cls(cfg.pp, cfg.dp_replicate, dp_shard, cfg.cp, cfg.tp, world_size, cfg.ep)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP shards over dp_shard x cp (context-parallel ranks hold the same parameters) and replicates over
        dp_replicate."""
        return self.dp * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def fsdp_shard(self) -> int:
        """Ranks one FSDP shard group spans (parameters are split this many ways)."""
        return self.dp_shard * self.cp

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of dp_shard that expert parallelism spans (with every cp and tp rank)."""
        return self.ep // (self.cp * self.tp) if self.ep_enabled else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The rest of dp_shard: FSDP shards the experts over it (with dp_replicate: HSDP)."""
        return self.dp_shard // self.dp_shard_in_ep

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")
                 if name != "cp" or self.cp > 1]
        experts = f", ep={self.ep}" if self.ep_enabled else ""
        return " x ".join(parts) + f" (world {self.world_size}{experts})"


def stages_per_rank(cfg: Config) -> int:
    p = cfg.parallel
    if p.pp_schedule == "zbv":
        return 2  # the V shape: rank r holds stages r and 2*pp-1-r
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES:
        return 1
    return p.pp_stages_per_rank


def n_microbatches(cfg: Config) -> int:
    """parallel.pp_microbatches, or one per pipeline stage when 0."""
    p = cfg.parallel
    return p.pp_microbatches or p.pp * stages_per_rank(cfg)


def last_stage_losses_in_flight(cfg: Config) -> int:
    """Micro-batches whose head loss the last pipeline stage holds between its forward and its weight backward,
    in torch 2.13's schedule orders: GPipe runs every forward first; interleaved zero-bubble defers the last
    stage's weight passes by a round of pp micro-batches; 1F1B, interleaved 1F1B and ZBV run each last-stage
    backward (ZBV: input and weight pass) right after its forward."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return n_microbatches(cfg)
    if p.pp_schedule == "interleaved_zb":
        return min(n_microbatches(cfg), p.pp)
    return 1


def total_layers(cfg: Config) -> int:
    return get_family_spec(cfg.model.family).total_layers(cfg.model)


def validate_parallel(cfg: Config, world_size: int, device: torch.device | str | None = None, *,
                      on_this_host: bool = True) -> ParallelDims:
    """Resolve and check the layout; returns the dimensions. Raises ConfigError naming the key to change.
    on_this_host=False (e.g. `submit` on a login node): the device's features are not checked here."""
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    device_type = torch.device(device).type if device is not None else _configured_device_type(cfg)
    check_context_parallel(cfg, dims)
    if cfg.model.position == "t5_relative" and (dims.tp > 1 or dims.pp > 1):
        # TP would have to slice the bias per rank's heads and PP to share each stack's table between stages.
        raise ConfigError(f"parallel.tp={dims.tp}, parallel.pp={dims.pp}: t5_relative position bias is not supported "
                          "with tensor/pipeline parallel yet; use FSDP/HSDP (tp=1, pp=1) or model.position='alibi'")
    _check_tensor_parallel(cfg, dims)
    check_expert_parallel(cfg, dims)
    _check_pipeline(cfg, dims)
    _check_precision(cfg, dims, device_type, on_this_host)
    _check_moe_backend(cfg, device_type, on_this_host)
    p = cfg.parallel
    if p.recompute == "every_k" and p.recompute_every < 1:
        raise ConfigError(f"parallel.recompute_every must be >= 1, got {p.recompute_every}")
    check_compiled_recompute(cfg, dims)
    if p.timeout_s <= 0:
        raise ConfigError(f"parallel.timeout_s must be positive (seconds), got {p.timeout_s}")
    return dims


def check_compiled_recompute(cfg: Config, dims: ParallelDims) -> None:
    """Full recomputation under train.compile only where the weights are plain tensors (the planner's search skips
    the layouts this refuses)."""
    p = cfg.parallel
    if cfg.train.compile not in (False, "off") and p.recompute in ("full", "every_k") and (dims.tp > 1 or dims.ep > 1):
        raise ConfigError(f"parallel.recompute='{p.recompute}' with train.compile and tensor or expert parallel: torch "
                          "2.13 cannot compile a fully recomputed block whose weights are distributed tensors (it "
                          "saves their device mesh among the tensors for backward); use parallel.recompute='selective' "
                          "(compiled too; recomputes all but the matmuls) or train.compile=false")


def _configured_device_type(cfg: Config) -> str:
    spec = cfg.train.device
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(spec).type


def check_context_parallel(cfg: Config, dims: ParallelDims) -> None:
    if dims.cp == 1:
        return
    m, key = cfg.model, f"parallel.cp={dims.cp}"
    for kind in model_kinds(m):
        refusal = kind.context_parallel(m)
        if refusal is not None:
            raise ConfigError(f"{key}: {kind.name} blocks: {refusal}; set parallel.cp=1 (tp or FSDP)")
        if cfg.parallel.cp_method == "ulysses" and (refusal := kind.ulysses(m, dims.cp, dims.tp)) is not None:
            raise ConfigError(f"{key}, cp_method='ulysses': {kind.name} blocks: {refusal}")
    if cfg.parallel.cp_method == "ulysses" and cfg.optim.qk_clip_threshold:
        raise ConfigError(f"{key}, cp_method='ulysses': optim.qk_clip_threshold records each head's largest logit "
                          "on the rank holding its whole sequence, which Ulysses moves; use "
                          "parallel.cp_method='allgather'")
    if cfg.data.seq_len % (2 * dims.cp):
        raise ConfigError(f"{key} cuts each sequence into {2 * dims.cp} equal pieces (2 per rank, for balanced "
                          f"causal work), but data.seq_len={cfg.data.seq_len} is not divisible by {2 * dims.cp}; "
                          "choose a seq_len that is a multiple of 2 x cp")
    piece = cfg.data.seq_len // (2 * dims.cp)
    for kind in model_kinds(m):
        if piece % (multiple := kind.context_piece_multiple(m)):
            raise ConfigError(f"{key}: {kind.name} blocks need each of the {2 * dims.cp} sequence pieces to hold a "
                              f"multiple of {multiple} tokens, but data.seq_len={cfg.data.seq_len} gives pieces of "
                              f"{piece}; choose a data.seq_len that is a multiple of 2 x cp x {multiple} = "
                              f"{2 * dims.cp * multiple}")
    if dims.tp > 1 and (cfg.data.seq_len // dims.cp) % dims.tp:
        raise ConfigError(f"{key} with parallel.tp={dims.tp}: each rank's {cfg.data.seq_len // dims.cp} tokens must "
                          f"split evenly over the tensor-parallel ranks (sequence parallel); choose a data.seq_len "
                          f"that is a multiple of cp x tp = {dims.cp * dims.tp} (and of 2 x cp)")


def _check_tensor_parallel(cfg: Config, dims: ParallelDims) -> None:
    tp, m = dims.tp, cfg.model
    if tp == 1:
        return
    for kind in model_kinds(m):
        refusal = kind.tensor_parallel(m)
        if refusal is not None:
            raise ConfigError(f"parallel.tp={tp}: {kind.name} blocks: {refusal}; set parallel.tp=1 (pp or FSDP)")
    # the sizes the blocks' kinds split (model/components/), each key once
    checks = list(dict.fromkeys(check for kind in model_kinds(m) for check in kind.tp_divides(m)))
    checks += [
        ("model.vocab_size", m.vocab_size, "embeddings and the output head are split on the vocabulary"),
        ("data.seq_len", cfg.data.seq_len, "sequence parallel splits the sequence between blocks"),
    ]
    if get_family_spec(m.family).seq2seq:
        checks.append(("data.target_len", cfg.data.target_len, "sequence parallel splits the target sequence"))
    for key, value, why in checks:
        if value % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide {key}={value} ({why}); choose a tp that divides "
                              f"{key} or change {key}")


def check_expert_parallel(cfg: Config, dims: ParallelDims) -> None:
    m, ep = cfg.model, dims.ep
    if m.moe.n_experts == 0:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep} splits experts, but the model has none (model.moe.n_experts=0); set "
                              "parallel.ep=1, or give the model experts (model.moe.n_experts)")
        return
    if dims.tp > 1 and ep % dims.tp:
        raise ConfigError(f"parallel.tp={dims.tp} with experts: under sequence parallel each tensor-parallel rank "
                          f"routes its own tokens, so the experts are split over those ranks too; set parallel.ep to "
                          f"a multiple of tp (ep={dims.tp * dims.cp} or more)")
    if ep == 1:
        return
    if m.moe.n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.moe.n_experts={m.moe.n_experts} (each rank holds "
                          "n_experts / ep whole experts); choose an ep that divides n_experts")
    inner = dims.cp * dims.tp
    if ep % inner or dims.dp_shard % (ep // inner):
        raise ConfigError(f"parallel.ep={ep} must be taken from dp_shard={dims.dp_shard} x cp={dims.cp} x "
                          f"tp={dims.tp}: a multiple of cp x tp = {inner} whose quotient divides dp_shard; choose ep "
                          f"in {_ep_choices(dims)}")
    uneven = uneven_expert_shard(cfg, dims)
    if uneven is not None:
        name, shape, dim = uneven
        shards = dims.dp_shard_mod_ep
        fits = [e for e in _ep_choices(dims)
                if m.moe.n_experts % e == 0 and uneven_expert_shard(cfg, replace(dims, ep=e)) is None]
        raise ConfigError(f"parallel.ep={ep}: FSDP shards each expert-parallel rank's experts over the {shards} "
                          f"data-parallel ranks ep leaves (dp_shard / (ep / (cp x tp))), and with "
                          f"{shape[0]} local experts (not a multiple of {shards}) it splits dim {dim} of "
                          f"experts.{name} {tuple(shape)}, which must divide evenly: {shape[dim]} % {shards} != 0; "
                          + (f"choose parallel.ep in {fits}, or " if fits else "choose ")
                          + f"a world size whose expert FSDP degree divides {shape[dim]}")


def expert_shard_dim(local_experts: int, shards: int) -> int:
    """The dim FSDP shards expert weights on over `shards` ranks: whole experts (dim 0) when they split evenly, else
    each expert's rows (dim 1), so every rank holds an equal piece."""
    return 0 if local_experts % shards == 0 else 1


def uneven_expert_shard(cfg: Config, dims: ParallelDims) -> tuple[str, tuple[int, ...], int] | None:
    """(name, local shape, dim) of the first expert weight whose FSDP shard dim does not divide evenly over the
    data-parallel ranks expert parallelism leaves, or None. FSDP2 pads only dim 0; it refuses an uneven other dim."""
    if not dims.ep_enabled or cfg.model.moe.n_experts % dims.ep:
        return None
    shards = dims.dp_shard_mod_ep
    for name, shape in expert_shapes(cfg.model).items():
        local = (shape[0] // dims.ep, *shape[1:])
        dim = expert_shard_dim(local[0], shards)
        if dim > 0 and local[dim] % shards:
            return name, local, dim
    return None


def _ep_choices(dims: ParallelDims) -> list[int]:
    inner = dims.cp * dims.tp
    return [inner * d for d in range(1, dims.dp_shard + 1) if dims.dp_shard % d == 0]


def _check_pipeline(cfg: Config, dims: ParallelDims) -> None:
    p = cfg.parallel
    if dims.pp == 1:
        return
    spr = stages_per_rank(cfg)
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES and p.pp_stages_per_rank != 1:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} runs one stage per rank; set "
                          "parallel.pp_stages_per_rank=1 or use interleaved_1f1b / interleaved_zb")
    if p.pp_schedule == "zbv" and p.pp_stages_per_rank not in (1, 2):
        raise ConfigError("parallel.pp_schedule='zbv' places exactly 2 stages per rank (a V); set "
                          "parallel.pp_stages_per_rank=2 (or leave it at 1)")
    if spr < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank must be >= 1, got {p.pp_stages_per_rank}")
    n_stages = dims.pp * spr
    layers = total_layers(cfg)
    if n_stages > layers:
        raise ConfigError(
            f"parallel.pp={dims.pp} x {spr} stage(s) per rank = {n_stages} pipeline stages, but the model has only "
            f"{layers} layers; every stage needs at least one layer: lower parallel.pp (or pp_stages_per_rank) "
            "or add layers"
        )
    if p.pp_split_points:
        points = list(p.pp_split_points)
        if len(points) != n_stages - 1:
            raise ConfigError(f"parallel.pp_split_points={points} must list {n_stages - 1} layer indices (where "
                              f"stages 1..{n_stages - 1} begin) for {n_stages} stages")
        if points != sorted(set(points)) or points[0] <= 0 or points[-1] >= layers:
            raise ConfigError(f"parallel.pp_split_points={points} must be strictly increasing layer indices in "
                              f"1..{layers - 1} (encoder layers first, then decoder layers)")
    if p.pp_schedule in ZERO_BUBBLE and p.recompute == "selective":
        raise ConfigError(f"parallel.recompute='selective' cannot run under parallel.pp_schedule={p.pp_schedule!r}: "
                          "zero-bubble schedules backpropagate each block twice (inputs, then weights) and torch's "
                          "selective checkpointing allows one backward; use recompute='full' or 'every_k', or a "
                          "1f1b / interleaved_1f1b schedule")
    n_mb = n_microbatches(cfg)
    if n_mb < 1:
        raise ConfigError(f"parallel.pp_microbatches must be >= 1 (or 0 for one per stage), got {n_mb}")
    if p.pp_schedule != "gpipe" and n_mb < dims.pp:
        raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} needs at least pp={dims.pp} microbatches to fill "
                          f"the pipeline, got parallel.pp_microbatches={n_mb}; raise it to >= {dims.pp}")
    if p.pp_schedule in ("interleaved_1f1b", "interleaved_zb"):
        rounds = max(1, n_mb // dims.pp)
        if n_mb % rounds:
            raise ConfigError(f"parallel.pp_schedule={p.pp_schedule!r} needs parallel.pp_microbatches to be a "
                              f"multiple of pp={dims.pp} (or smaller than it), got {n_mb}")
    if cfg.data.batch_size < n_mb:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} is smaller than the {n_mb} pipeline microbatches; "
                          "raise data.batch_size or lower parallel.pp_microbatches")
    if cfg.data.batch_size % n_mb:  # the schedule splits each batch into equal microbatches
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} does not split into the {n_mb} pipeline "
                          "microbatches", f"set data.batch_size to a multiple of {n_mb}, or set "
                          "parallel.pp_microbatches to a divisor of it")


def _check_precision(cfg: Config, dims: ParallelDims, device_type: str, on_this_host: bool) -> None:
    p = cfg.parallel
    wants_bf16 = cfg.train.dtype == "bf16" or p.mixed_precision_param == "bf16" or p.mixed_precision_reduce == "bf16"
    if wants_bf16 and on_this_host and not bf16_supported(device_type):
        raise ConfigError(f"bf16 was requested (train.dtype / parallel.mixed_precision_*) but this {device_type} "
                          "device has no bf16 support; use fp32")
    if (p.mixed_precision_param != "fp32" or p.mixed_precision_reduce != "fp32") and not dims.fsdp_enabled:
        raise ConfigError("parallel.mixed_precision_param/_reduce configure FSDP, which is off with a data-parallel "
                          "size of 1; use train.dtype='bf16' (autocast) instead, or add data-parallel ranks")


def _check_moe_backend(cfg: Config, device_type: str, on_this_host: bool) -> None:
    """An explicit moe_backend='grouped_mm' that torch._grouped_mm cannot run fails here, not in the first forward."""
    from meshformer.model import moe

    m, p = cfg.model, cfg.parallel
    if m.moe.n_experts == 0 or m.moe.backend != "grouped_mm":
        return
    if device_type == "cuda" and cfg.train.dtype != "bf16" and p.mixed_precision_param != "bf16":
        raise ConfigError("model.moe.backend='grouped_mm' runs bf16 rows on CUDA, but this run computes in fp32",
                          "set train.dtype='bf16' (or parallel.mixed_precision_param='bf16'), or use "
                          "model.moe.backend='auto' (grouped_mm where it runs, else the loop)")
    if on_this_host and not moe.grouped_mm_runs(device_type):
        raise ConfigError(f"model.moe.backend='grouped_mm', but torch._grouped_mm does not run on this {device_type} "
                          "(CUDA needs compute capability 9.0 or newer)", "use model.moe.backend='auto' (grouped_mm "
                          "where it runs, else the loop) or 'padded'")


def bf16_supported(device_type: str) -> bool:
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device_type == "cpu":
        return True  # native on AVX512-bf16/AMX, emulated (slow but correct) elsewhere
    return False
