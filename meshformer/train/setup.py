"""A run's set-up, in the order the trainer does it: each step takes what it needs and returns a typed piece.

`Trainer.__init__` is these steps in this order, and a replica group restarted by its launcher (fault_tolerance)
runs them again. The last step, `restore_state`, runs when training starts (`Trainer.fit`): from the newest
checkpoint at a start or restart, or from a live peer's state at a heal (train/replica_step.py).

1. `resolve_config`: checkpoint.init_from's model config; the callbacks built (a bad one stops the run here)
2. `place`: this rank's device, host memory policy, parallel layout and peak FLOP/s
3. `open_run`: the run folder, its logger and the hang watchdog
4. `load_tokenizer`: data.tokenizer (unless preflight already loaded it)
5. `build_model`: meta build, loss, parallelize (sharded and materialised)
6. `build_optimizer`: optimizer, schedule and the update (a `TrainStep`)
7. `build_callbacks`: downstream tasks, built-in, fault-tolerance and user callbacks
8. `build_data`: this rank's training and held-out loaders
9. `track_state`: step counters, what a checkpoint saves, the checkpoint manager
10. `restore_state` (at `fit`): the state a checkpoint or a live peer holds
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing.init_from import resolve_init_from
from meshformer.checkpointing.live_state import load_live_state
from meshformer.checkpointing.manager import CheckpointManager
from meshformer.checkpointing.train_state import Checkpointable, SchedulerState, Stateful, TrainState
from meshformer.config import Config
from meshformer.data import Loader, Tokenizer, build_loader
from meshformer.loss.cross_entropy import LossFn
from meshformer.model import Transformer
from meshformer.model.families import get_family_spec
from meshformer.model.flops import flops_per_token
from meshformer.model.init import new_seed
from meshformer.parallel import parallelize
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.parallelize import world_size
from meshformer.parallel_dims import ParallelDims, validate_parallel
from meshformer.runtime.distributed import job_device
from meshformer.runtime.host_memory import apply_host_memory_policy, release_free_host_memory
from meshformer.runtime.watchdog import HangWatchdog
from meshformer.train.builtin_callbacks import builtin_callbacks
from meshformer.train.callbacks import (
    Callback,
    Callbacks,
    diagnostics_dir,
    labelled_config_callbacks,
    loaded_line,
    user_label,
)
from meshformer.train.downstream import DownstreamEval
from meshformer.train.loss_choice import resolve_loss
from meshformer.train.metrics import FlopsCeiling, RunLogger, peak_flops
from meshformer.train.preflight import checked_tokenizer
from meshformer.train.replica_step import ReplicaMetrics, data_share, replica_group
from meshformer.train.step import TrainStep


@dataclass(frozen=True)
class ResolvedConfig:
    cfg: Config
    callbacks: list[tuple[str, Callback]]  # the config's and the caller's callbacks, each with its error label


@dataclass(frozen=True)
class Placement:
    device: torch.device
    world_size: int  # processes in this job (one replica group, under fault_tolerance)
    dims: ParallelDims
    host_memory: str  # the allocator policy in force (runtime/host_memory.py), for the start-up line
    ceiling: FlopsCeiling


@dataclass(frozen=True)
class RunOutput:
    run_dir: Path
    logger: RunLogger
    watchdog: HangWatchdog


@dataclass(frozen=True)
class BuiltModel:
    parallel: ParallelModel
    # The whole model, for decoded samples; pipeline stages hold copies of their pieces, so None there.
    model: Transformer | None
    n_params: int
    build_s: float  # meta build, sharding and materialisation of this rank
    target_len: int | None  # encoder-decoder: target tokens per sample, which count towards tokens/s and MFU
    flops_per_token: float


@dataclass(frozen=True)
class RunCallbacks:
    downstream: DownstreamEval | None
    callbacks: Callbacks


@dataclass(frozen=True)
class RunData:
    train: Loader
    eval: Loader


@dataclass(frozen=True)
class RunState:
    state: TrainState
    checkpointable: Checkpointable  # everything a checkpoint saves and a resume or heal restores
    checkpoints: CheckpointManager


def resolve_config(cfg: Config, extra: Sequence[Callback] = ()) -> ResolvedConfig:
    """First: a callback that cannot be built stops the run before any model or data work."""
    cfg = resolve_init_from(cfg)  # checkpoint.init_from: the model config of the HF folder (a no-op if resolved)
    return ResolvedConfig(cfg, [*labelled_config_callbacks(cfg), *((user_label(c), c) for c in extra)])


def place(cfg: Config, local_rank: int, dims: ParallelDims | None) -> Placement:
    """dims: the layout `init_distributed` validated when it joined the process group (else validated here)."""
    device, world = job_device(cfg, local_rank), world_size()
    # Before any large tensor (runtime/host_memory.py): CPU ranks of a multi-process run map large tensors so
    # freed FSDP buffers leave RSS; one CPU process reuses what it frees instead of re-faulting it each step.
    host_memory = apply_host_memory_policy(device.type, world)
    if dims is None:
        dims = validate_parallel(cfg, world, device)  # before the model is built (and sharded)
    # Measured first, before data workers or other ranks' set-up compete for the device.
    ceiling = FlopsCeiling(*peak_flops(device, torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32))
    return Placement(device, world, dims, host_memory, ceiling)


def open_run(cfg: Config, rank: int, world: int, callbacks: Sequence[tuple[str, Callback]]) -> RunOutput:
    run_dir = Path(cfg.logging.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)  # config.toml is written when training starts (Trainer.fit)
    logger = RunLogger(run_dir, enabled=rank == 0, tensorboard=cfg.logging.tensorboard,
                       wandb=cfg.logging if cfg.logging.wandb else None, run_config=cfg.to_dict())
    for _, callback in callbacks:
        logger.info(loaded_line(callback))
    # Cluster diagnostics: per-rank hang reports (stalls, collective timeouts) name the phase of the step.
    watchdog = HangWatchdog(run_dir, rank=rank, world_size=world, timeout_s=cfg.parallel.timeout_s,
                            enabled=world > 1, replica_group=replica_group(cfg))
    return RunOutput(run_dir, logger, watchdog)


def load_tokenizer(cfg: Config, given: Tokenizer | None) -> Tokenizer:
    """given: the one preflight loaded and checked, when the caller ran preflight."""
    return given if given is not None else checked_tokenizer(cfg)


def build_model(cfg: Config, placement: Placement, loss: LossFn | None) -> BuiltModel:
    start = time.perf_counter()
    # The loss follows train.loss / label_smoothing / z_loss (fused head loss or full logits; vocab-parallel),
    # checked against the device and layout before any model work; the parallel model autocasts when bf16.
    loss_spec = resolve_loss(cfg, placement.dims, placement.device.type, loss)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank and layout
    init_seed = new_seed()  # the seed Transformer(cfg.model) would draw here: the same weights as one process
    # Built on the meta device: parallelize shards it, then each rank allocates and initialises only its shards.
    with torch.device("meta"):
        model = Transformer(cfg.model, init_seed=init_seed)
    parallel = parallelize(model, cfg, placement.device, loss_spec, placement.dims)
    whole = model if parallel.supports_generation else None
    release_free_host_memory()  # what materialisation's transient full tensors left in the heap
    build_s = time.perf_counter() - start
    target_len = cfg.data.target_len if get_family_spec(cfg.model.family).seq2seq else None
    return BuiltModel(parallel, whole, sum(p.numel() for p in model.parameters()), build_s, target_len,
                      flops_per_token(cfg.model, cfg.data.seq_len, target_len))


def build_optimizer(cfg: Config, parallel: ParallelModel, on_phase: Callable[..., None]) -> TrainStep:
    return TrainStep(parallel, cfg.optim, cfg.schedule, cfg.train.steps, cfg.model.d_model, on_phase=on_phase)


def build_callbacks(cfg: Config, tokenizer: Tokenizer, user: Sequence[tuple[str, Callback]], rank: int,
                    on_phase: Callable[..., None]) -> RunCallbacks:
    """Before the data: a downstream task that cannot be read stops the run before the shards are opened."""
    downstream = DownstreamEval.from_config(cfg, tokenizer)  # downstream.tasks (None: none listed)
    fault_tolerance: list[Callback] = [ReplicaMetrics()] if cfg.fault_tolerance.enabled else []
    callbacks = Callbacks([*builtin_callbacks(cfg, downstream), *fault_tolerance, *(c for _, c in user)], rank,
                          on_phase=on_phase, labels={id(c): label for label, c in user},
                          diagnostics=diagnostics_dir(cfg))
    return RunCallbacks(downstream, callbacks)


def build_data(cfg: Config, tokenizer: Tokenizer, parallel: ParallelModel) -> RunData:
    dp_rank, dp_size = parallel.dp_rank, parallel.dp_size
    # fault_tolerance: this replica group's share of the global order (train/replica_step.py)
    return RunData(build_loader(cfg, tokenizer, "train", *data_share(cfg, dp_rank, dp_size)),
                   build_loader(cfg, tokenizer, "eval", dp_rank, dp_size))


def track_state(cfg: Config, device: torch.device, parallel: ParallelModel, training_step: TrainStep,
                data: RunData, callbacks: Callbacks, output: RunOutput, tokenizer: Tokenizer) -> RunState:
    state = TrainState(device)  # step, target tokens trained on
    # Everything a checkpoint saves and a resume restores (RNG streams: per rank, by the manager).
    components: dict[str, Stateful] = {"scheduler": SchedulerState(training_step.scheduler), "data": data.train}
    if callbacks.state is not None:  # only then: checkpoints of runs without stateful callbacks stay alike
        components["callbacks"] = callbacks.state
    checkpointable = Checkpointable(state, parallel.model_parts, training_step.optimizer, components, cfg)
    checkpoints = CheckpointManager.from_config(cfg, output.run_dir, log=output.logger.info)
    checkpoints.tokenizer = tokenizer  # checkpoints carry it, as final/ does
    return RunState(state, checkpointable, checkpoints)


def restore_state(run: Checkpointable, source: CheckpointManager | dict[str, Any]) -> bool:
    """The training state (weights, optimizer, schedule, data position, callbacks' state, step, RNG streams) from
    the newest checkpoint (`source` a CheckpointManager: a start or restart; False when there is none), or from a
    live peer's `live_state` (a heal: the same pieces, sent process to process)."""
    if isinstance(source, CheckpointManager):
        return source.resume(run)
    load_live_state(run, source)
    return True
