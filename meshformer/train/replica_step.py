"""The trainer's side of fault-tolerant replica groups (fault_tolerance.enabled; docs/fault-tolerance.md).

Each step of a replica group:

1. `start_step`: the step's quorum from the Lighthouse (meshformer/runtime/fault_tolerance.py). A group behind the
   quorum (restarted) heals here from a live peer: weights, optimizer state, schedule, data position, callbacks'
   state, step and RNG streams (checkpointing/live_state.py), before it reads the step's batches.
2. The step's forward/backward on this group's share of the global batch.
3. `sync` (TrainStep's gradient sync): one all-reduce averages the gradients over the groups in the quorum, then
   the group votes on the commit. Without a commit (a peer died in the all-reduce, too few replicas) the update
   is dropped, the data position goes back to where the step started, and the step is tried again with the next
   quorum.

Data: group r of R reads ranks r*dp .. (r+1)*dp-1 of the global order split R*dp ways (dp: the group's own
data-parallel size), so every step consumes R shares of the global order whichever groups are alive. The shares of
groups absent at a step are skipped, not trained later. The record says which shares were trained: every committed
step adds one line per group to that group's `replicas.jsonl` (its step, the groups averaged, the global data
position the step started at, its share, and the wall-clock time it committed); the union over the groups' run
folders is the run's record.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshformer.checkpointing.live_state import live_state
from meshformer.checkpointing.state import named_parameters
from meshformer.config import Config
from meshformer.config.sections import FaultToleranceConfig
from meshformer.runtime.fault_tolerance import (
    FaultToleranceError,
    ReplicaGroup,
    SemiSync,
    StepSync,
    lighthouse_address,
    outer_optimizer,
    replica_id_from_env,
    require_torchft,
)
from meshformer.runtime.stop import StopAgreed, signal_name
from meshformer.train.callbacks import Callback, CallbackContext

if TYPE_CHECKING:
    from meshformer.train.trainer import Trainer

RECORD = "replicas.jsonl"  # in each group's run folder: the steps it trained, with which groups and which data


def replica_run_dir(run_dir: str | Path, replica_id: int) -> Path:
    return Path(run_dir) / f"replica-{replica_id}"


def replica_config(cfg: Config) -> Config:
    """The config one replica group runs: its own run folder (metrics, checkpoints, final weights) under
    logging.run_dir, and checkpoint.dir likewise; unchanged without fault tolerance."""
    if not cfg.fault_tolerance.enabled:
        return cfg
    require_torchft()  # before any work
    r = replica_id_from_env(cfg.fault_tolerance.replica_groups)
    lighthouse_address(cfg.fault_tolerance)
    checkpoint = cfg.checkpoint
    if checkpoint.dir:
        checkpoint = replace(checkpoint, dir=str(replica_run_dir(checkpoint.dir, r)))
    return replace(cfg, logging=replace(cfg.logging, run_dir=str(replica_run_dir(cfg.logging.run_dir, r))),
                   checkpoint=checkpoint)


def replica_group(cfg: Config) -> int | None:
    """This process's replica group (None without fault tolerance)."""
    return replica_id_from_env(cfg.fault_tolerance.replica_groups) if cfg.fault_tolerance.enabled else None


def data_share(cfg: Config, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(rank, size) of this process's share of the global order: the group's data-parallel ranks, placed after
    those of the groups before it."""
    if not cfg.fault_tolerance.enabled:
        return dp_rank, dp_size
    r = replica_id_from_env(cfg.fault_tolerance.replica_groups)
    return r * dp_size + dp_rank, cfg.fault_tolerance.replica_groups * dp_size


class NoQuorum(StopAgreed):
    """No quorum for fault_tolerance.wait_s: the trainer stops as after a stop signal (a checkpoint of the step
    reached), then `ReplicaTraining.close` raises the error."""

    def __init__(self, error: FaultToleranceError) -> None:
        BaseException.__init__(self, str(error))
        self.error, self.signum = error, 0


def _any_rank(flag: bool) -> bool:
    """True on every rank of this replica group where it is True on any (the group's own process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


WINDOW = "ft_window"  # the checkpoint component of WindowGroups


class WindowGroups:
    """local_sgd / diloco: the groups of the synchronisation that opened the window a step is in, which the record
    names for each step of the window. A checkpoint keeps them (trainer_state.json, component `ft_window`), so a
    group resumed inside a window records the rest of it as the uninterrupted run did; optional: a checkpoint saved
    without it resumes with the group alone until the window's synchronisation."""

    optional = True

    def __init__(self, training: ReplicaTraining) -> None:
        self.training = training

    def state_dict(self) -> dict[str, Any]:
        return {"replicas": list(self.training.last.replicas)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.training.last = StepSync(tuple(int(r) for r in state["replicas"]), 0.0)


ANCHOR, MOMENTUM = "anchor.", "momentum."


class OuterState:
    """fault_tolerance.method = "diloco": the outer state a checkpoint keeps next to the group's own weights and
    optimizer, under `outer.` in its tensor files, each tensor laid out as its parameter: the weights of the last
    synchronisation (`anchor.`, which the next pseudo-gradient is taken from) and the outer optimizer's Nesterov
    momentum (`momentum.`). The position in the window is the step's. Made before the group's torchft DiLoCo (which
    a resume precedes); `attach` hands the loaded anchor to it, and from then on the tensors are torchft's (those a
    heal sends)."""

    def __init__(self, cfg: FaultToleranceConfig, model_parts: list[torch.nn.Module]) -> None:
        self.named = named_parameters(model_parts)
        self.outer = outer_optimizer(cfg, torch.nn.ModuleList(model_parts).parameters())  # SemiSync's order
        self._anchor: dict[int, torch.Tensor] = {}  # id(parameter) -> this rank's shard, on the host
        self.resumed = False  # a checkpoint gave the anchor

    def attach(self, semi: SemiSync) -> None:
        anchor = semi.anchor()
        with torch.no_grad():
            for key, tensor in self._anchor.items():
                anchor[key].copy_(tensor)
        self._anchor = anchor

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named:
            if id(p) in self._anchor:
                out[ANCHOR + name] = _shaped_as(p, self._anchor[id(p)])
            momentum = self.outer.state.get(p, {}).get("momentum_buffer")
            if momentum is not None:
                out[MOMENTUM + name] = momentum
        return out

    def load_templates(self, saved: set[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.named:
            if ANCHOR + name in saved:
                local = p.to_local() if isinstance(p, DTensor) else p
                self._anchor[id(p)] = torch.empty(local.shape, dtype=local.dtype)
                out[ANCHOR + name] = _shaped_as(p, self._anchor[id(p)])
            if MOMENTUM + name in saved:
                momentum = torch.zeros_like(p.detach())
                self.outer.state[p]["momentum_buffer"] = momentum
                out[MOMENTUM + name] = momentum
        return out

    def loaded(self, keys: set[str]) -> None:
        self.resumed = any(key.startswith(ANCHOR) for key in keys)


def _shaped_as(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's shard of a copy of `param`) laid out as `param` for the checkpoint (no copy)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


class ReplicaTraining:
    """One rank's part in the run's replica groups: quorum, heal, gradient average, commit, record."""

    def __init__(self, trainer: Trainer) -> None:
        require_torchft()
        self.trainer = trainer
        self.cfg = trainer.cfg.fault_tolerance
        self.replica_id = replica_id_from_env(self.cfg.replica_groups)
        self.group: ReplicaGroup | None = None  # joined at the first step: a group heartbeating earlier would
        # hold up the others' quorums while it resumes
        self.last = StepSync((self.replica_id,), 0.0)  # the last step's all-reduce
        self.committed = True
        self._members: tuple[int, ...] = ()
        self._data_state: dict[str, Any] = {}
        self._position = 0
        self._last_commit = time.perf_counter()
        self.record = trainer.run_dir / RECORD
        self.semi: SemiSync | None = None  # method local_sgd / diloco: made with the group
        self._synced_at: int | None = None  # the step of the last synchronisation (local_sgd / diloco)
        self.no_quorum: FaultToleranceError | None = None  # set where the run stopped for want of a quorum
        self._stop = 0  # the stop signal this group agreed on, sent in the next step's all-reduce (method sync)
        self._first_step = 0
        self._joined = False  # this process has had a quorum
        self._local_start = False  # resumed inside a window: local steps until its synchronisation, then the group
        self.outer: OuterState | None = None
        if self.cfg.method == "diloco":  # in checkpoints, and loaded by a resume before the group is made
            self.outer = OuterState(self.cfg, trainer.parallel_model.model_parts)
            trainer.checkpointable.tensor_components["outer"] = self.outer
        if self.cfg.method != "sync":  # each step of a window is recorded with the groups that opened it
            run = trainer.checkpointable
            run.components = {**run.components, WINDOW: WindowGroups(self)}
        trainer.training_step.gradient_sync = self.sync

    def start_step(self) -> None:
        """This step's quorum (a heal moves the trainer to the peer's step); remembers where the data stands."""
        trainer = self.trainer
        trainer.watchdog.phase("quorum", trainer.step + 1)  # a hang report here: waiting for the other groups
        first = self.group is None
        if first and self._starts_inside_a_window():
            self._remember_data()  # a local step of the window the checkpoint was taken in: no quorum yet
            return
        if self.group is None:
            self._make_group()
        elif self.semi is not None and not self.semi.due(trainer.step):
            self._remember_data()  # a local step: no quorum
            return
        assert self.group is not None
        before = trainer.step
        took = self._join()
        if first and self.group.healed_s is None:
            self._trim_record(trainer.step)
        if self.group.healed_s is not None:
            trainer.logger.info(f"fault tolerance: replica group {self.replica_id} healed from a live peer at step "
                                f"{trainer.step} (was at step {before}) in {took:.2f}s: weights, optimizer, "
                                "schedule, data position and RNG")
        if self.semi is not None:
            self._synchronise()
        self._remember_data()

    def _make_group(self) -> None:
        trainer = self.trainer
        if not self._local_start:
            self._first_step = trainer.step  # where this run started (its checkpoint, or 0)

        def heal(state: dict[str, Any]) -> None:  # the set-up's restore step, from a live peer's state
            trainer.restore_state(state)

        self.group = ReplicaGroup(self.cfg, self.replica_id, trainer.device,
                                  state_dict=lambda: live_state(trainer.checkpointable), load_state_dict=heal,
                                  log=trainer.logger.info)
        if self.cfg.method != "sync":  # registers DiLoCo's state with the Manager before the first heal
            self.semi = SemiSync(self.cfg, self.group, trainer.parallel_model.model_parts, trainer.optimizer,
                                 outer=self.outer.outer if self.outer is not None else None)
            if self.outer is not None:
                self.outer.attach(self.semi)  # the anchor a resume loaded (DiLoCo took the weights of now)
        # torchft's step (its commits) as if this group had trained from step 0: a group resumed from its
        # checkpoint is ahead of a fresh one, which heals from it (sync: one commit a step; local_sgd / diloco:
        # one a synchronisation, the first at step 0; a group that trained the rest of its window first counts those
        # before this one)
        step, h = trainer.step, self.cfg.sync_every
        commits = step if self.semi is None else (step // h + (0 if self._local_start else 1) if step else 0)
        self.group.manager.load_state_dict({"step": commits, "batches_committed": 0})

    def _starts_inside_a_window(self) -> bool:
        """local_sgd / diloco resumed from a checkpoint taken inside a window (diloco: one holding its outer state):
        the group trains the rest of the window from it, as the uninterrupted run did, and joins the quorum at the
        window's synchronisation (healing there if the others are ahead)."""
        step, h = self.trainer.step, self.cfg.sync_every
        if self.cfg.method == "sync" or step % h == 0 or (self.outer is not None and not self.outer.resumed):
            return False
        if not self._local_start:
            self._local_start, self._first_step = True, step
            self._trim_record(step)
            self.trainer.logger.info(f"fault tolerance: replica group {self.replica_id} resumed inside a window at "
                                     f"step {step}; it trains to the window's synchronisation after step "
                                     f"{(step // h + 1) * h} before it joins the quorum")
        return True

    def _join(self) -> float:
        """The step's quorum, waited for up to fault_tolerance.wait_s; after that, the run stops with a checkpoint."""
        assert self.group is not None
        # until its first quorum, a group waits for the others to start (there is nothing to stop and save yet)
        wait_s = self.cfg.wait_s if self._joined else math.inf
        try:
            stop = self.trainer.stop
            took = self.group.start_step_or_wait(wait_s, _any_rank, lambda: stop is not None and stop.requested)
            self._joined = True
            return took
        except FaultToleranceError as err:
            self.no_quorum = err
            step = self.trainer.step
            saves = " with a checkpoint" if step > self._first_step else " (no step trained: nothing to save)"
            self.trainer.logger.info(f"fault tolerance: replica group {self.replica_id} stops at step {step}{saves}: "
                                     f"{err.what}")
            raise NoQuorum(err) from None

    def _remember_data(self) -> None:
        self._data_state = self.trainer.train_data.state_dict()
        self._position = int(self._data_state["consumed"])

    def _synchronise(self) -> None:
        """local_sgd / diloco, after the quorum: the weights synchronised over it (one line where it failed)."""
        assert self.group is not None and self.semi is not None
        trainer, step = self.trainer, self.trainer.step
        members = self.group.members_and_stop(self._stop)
        if self.semi.sync():
            self._synced_at, self.last = step, StepSync(members.replicas, 0.0)
            stop = trainer.stop
            if members.stop and stop is not None and step < trainer.cfg.train.steps:
                # every group of the synchronisation stops here, with the weights it just agreed on
                if stop.signum is None:  # another group's signal: this group stops as if it had received it
                    stop.signum, stop._first_at = members.stop, time.monotonic()  # a signal now is the same one
                stop.stopping = True
                trainer.logger.info(f"fault tolerance: every replica group stops after step {step} "
                                    f"({signal_name(members.stop)} agreed in the synchronisation)")
                raise StopAgreed(members.stop)
            return
        kept = "keeps its own weights" if self.cfg.method == "local_sgd" else \
            f"goes back to the weights of the last synchronisation (step {self._synced_at})"
        why = self.group.error() or "fewer than fault_tolerance.min_replicas, or a rank of this group failed"
        trainer.logger.info(f"fault tolerance: the synchronisation after step {step} was not committed by replica "
                            f"group {self.replica_id} ({why}); it {kept} and tries again after "
                            f"fault_tolerance.sync_every={self.cfg.sync_every} steps")
        self.last = StepSync((self.replica_id,), 0.0)

    def stop_agreed(self, group_agreed: bool) -> bool:
        """After a committed step, given whether this group's ranks agreed to stop (runtime/stop.py): whether every
        group stops here. With method sync, a group's agreement rides in the next step's all-reduce and every group
        in that step's quorum stops after it, with the same signal; with local_sgd / diloco it rides in the next
        synchronisation, and every group in it stops there."""
        stop = self.trainer.stop
        if stop is None:
            return group_agreed
        if group_agreed and not self._stop:
            self._stop = stop.signum or 0
            if self.cfg.method != "sync":
                self.trainer.logger.info(
                    f"fault tolerance: replica group {self.replica_id} agreed on {signal_name(self._stop)} after step "
                    f"{self.trainer.step}; every group stops at the next synchronisation (fault_tolerance.sync_every="
                    f"{self.cfg.sync_every})")
        if self.cfg.method != "sync":  # the signal rides in the next synchronisation (_synchronise)
            return False
        if not self.last.stop:
            return False
        if stop.signum is None:  # another group's signal: this group stops and exits as if it had received it
            stop.signum, stop._first_at = self.last.stop, time.monotonic()  # a signal now is the same one
        stop.stopping = True
        self.trainer.logger.info(f"fault tolerance: every replica group stops after step {self.trainer.step} "
                                 f"({signal_name(self.last.stop)} agreed in its all-reduce)")
        return True

    def stop_in_evaluation(self, agreed: StopAgreed, step: int) -> bool:
        """A stop this group agreed on during the evaluation after `step` (StopAgreed from a batch of it): instead of
        stopping alone, the group leaves the evaluation and sends the signal in the next cross-group exchange, as a
        stop agreed after a step (`stop_agreed`); every group then stops at the same step. False where the group
        stops here by itself: after the last step (every group stops there anyway), or for want of a quorum."""
        if type(agreed) is not StopAgreed or step >= self.trainer.cfg.train.steps:
            return False
        if not self._stop:
            self._stop = agreed.signum
            after = "the next step" if self.cfg.method == "sync" else \
                f"the next synchronisation (fault_tolerance.sync_every={self.cfg.sync_every})"
            self.trainer.logger.info(f"fault tolerance: replica group {self.replica_id} agreed on "
                                     f"{signal_name(agreed.signum)} during the evaluation after step {step}; it "
                                     f"leaves the evaluation, and every group stops after {after}")
        return True

    def finish(self) -> None:
        """local_sgd / diloco, at train.steps: the last synchronisation, so every group ends with the same weights."""
        if self.cfg.method != "sync" and self._synced_at != self.trainer.step:
            if self.group is None and not self._local_start:
                return  # no step trained in this run
            if self.group is None:  # a resumed group that reached train.steps inside its first window
                self._make_group()
            self._join()
            self._synchronise()

    def sync(self, tokens: torch.Tensor) -> bool:
        """TrainStep's gradient sync: average over the quorum, then the commit vote; False drops the update."""
        if self.cfg.method != "sync":  # a local step: this group's own update, synchronised every sync_every steps
            self.last = StepSync(self.last.replicas, float(tokens))  # the groups of this window's synchronisation
            self.committed = True
            return True
        assert self.group is not None, "start_step comes first"
        self.trainer.watchdog.phase("cross_group")
        params = [p for part in self.trainer.parallel_model.model_parts for p in part.parameters()]
        self.last = self.group.average_gradients(params, tokens, self._stop)
        self.committed = self.group.should_commit()
        return self.committed

    def after_step(self, step: int) -> None:
        """After the step: a committed one is recorded (and quorum changes said in one line each); an uncommitted
        one puts the data position back, so the retried step reads the same batches."""
        trainer = self.trainer
        now = time.perf_counter()
        if not self.committed:
            assert self.group is not None
            trainer.train_data.load_state_dict(self._data_state)
            why = f"the all-reduce failed: {self.group.error()}" if self.group.error() else \
                "fewer than fault_tolerance.min_replicas, or a rank of this group failed"
            trainer.logger.info(f"fault tolerance: step {step} not committed by replica group {self.replica_id} "
                                f"({why}); trying it again with the next quorum")
            return
        members = self.last.replicas
        if self._members and members != self._members:
            gone, new = sorted(set(self._members) - set(members)), sorted(set(members) - set(self._members))
            what = "; ".join([f"replica group(s) {gone} dropped"] * bool(gone)
                             + [f"replica group(s) {new} joined"] * bool(new))
            trainer.logger.info(f"fault tolerance: {what} at step {step}: {len(members)} of "
                                f"{self.cfg.replica_groups} groups trained it, {now - self._last_commit:.2f}s "
                                "after the previous committed step")
        self._members, self._last_commit = members, now
        if trainer.rank == 0:
            line = {"step": step, "replica": self.replica_id, "replicas": list(members), "position": self._position,
                    "share": self.replica_id, "shares": self.cfg.replica_groups, "tokens": self.last.tokens,
                    "time": round(time.time(), 3)}
            with self.record.open("a") as file:
                file.write(json.dumps(line) + "\n")

    def _trim_record(self, step: int) -> None:
        """At the first step of a group that did not heal: lines of steps after `step` (trained by an interrupted
        run, whose updates no live group holds) go, as those steps are trained and recorded again. A healed group
        keeps its lines: the steps it trained before it failed live on in the peer's state it took."""
        if self.trainer.rank != 0 or not self.record.is_file():
            return
        lines = [line for line in self.record.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.record.write_text("".join(line + "\n" for line in lines))

    def close(self) -> None:
        """At the run's end, after its last checkpoint; a run stopped for want of a quorum ends in that error."""
        if self.group is not None:
            self.group.shutdown()
        if self.no_quorum is not None:
            raise self.no_quorum


class ReplicaMetrics(Callback):
    """ft/replicas (the groups that trained the step) and ft/tokens (their target tokens) on logging steps."""

    order = 15

    def on_step_end(self, ctx: CallbackContext) -> None:
        replicas = ctx.trainer.replicas
        if ctx.log_step and replicas is not None:
            ctx.metrics["ft/replicas"] = float(len(replicas.last.replicas))
            ctx.metrics["ft/tokens"] = replicas.last.tokens
