"""Replica groups on torchft: the data-parallel replicate dimension as independent jobs that train through failures.

A run with `fault_tolerance.enabled` is N replica groups. Each group is its own torchrun job with any layout inside
it (the same layout in every group), and `MESHFORMER_REPLICA_ID=r` in its environment. torchft supplies the rest:

- A **Lighthouse** (`torchft._torchft.LighthouseServer`, one per run: `meshformer lighthouse`) decides each
  step's quorum. It issues one as soon as every heartbeating group has asked to join (the same members as the
  last quorum: at once), or after `join_timeout_s` with at least `min_replicas`. A group that stops heartbeating
  for `heartbeat_timeout_s` is gone: this is the survivors' pause after a `kill -9` (about that long), instead
  of the collective timeout.
- A **Manager** (`torchft.manager.Manager`) per group process. Group rank 0 runs the group's `ManagerServer`
  (Rust), which talks to the Lighthouse and joins the group's ranks through the group's TCPStore (torchrun's
  MASTER_ADDR/PORT). `start_quorum()` asks for the step's quorum and reconfigures a **resizable process group**
  (`torchft.process_group.ProcessGroupGloo` / `ProcessGroupNCCL`) across the groups: rank i of every group
  in one process group, so each rank averages its own shards with its counterparts. `allreduce` on a dead peer
  errors quickly (gloo: connection closed) and is swallowed; `should_commit()` is then false in that group (a
  vote of the group's ranks through its ManagerServer), and the step is retried with the next quorum.
- **Healing**: a group whose step is behind the quorum's maximum fetches the state of a live peer (torchft's
  `HTTPTransport`: the peer serves the tensors it holds; rank i fetches from rank i) through the
  `state_dict`/`load_state_dict` functions given here. With `use_async_quorum=False` (used here) the heal is
  applied inside `start_quorum`, before the step's batches are read, so a healed group trains that step.
  The served tensors are the live ones (no copy): they stay unchanged until the peer's `should_commit`, which
  cannot come before the healer has fetched them and joined the step's all-reduce.
- torchft's own per-step logs (Rust, via RUST_LOG) are limited to warnings here.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshformer.config.sections import FaultToleranceConfig
from meshformer.errors import ConfigError, MeshformerError

REPLICA_ID_ENV = "MESHFORMER_REPLICA_ID"  # which replica group a process belongs to (0 .. replica_groups - 1)
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # the Lighthouse address when fault_tolerance.lighthouse is empty
INSTALL_HINT = "pip install 'meshformer[ft]'"


class FaultToleranceError(MeshformerError, RuntimeError):
    """A replica group that cannot take part in the run (no Lighthouse, no quorum): what and how to fix it."""


def require_torchft() -> Any:
    """The torchft package, or one line naming the extra that installs it."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    try:
        import torchft
    except ImportError:
        raise ConfigError("fault_tolerance.enabled needs torchft, which is not installed",
                          f"{INSTALL_HINT} (or set fault_tolerance.enabled=false)") from None
    # a warning per reconfiguration about NCCL's recorder, and an empty INFO record per quorum and commit
    # (and a traceback per failed all-reduce: the trainer says it in one line)
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # a heal's receiving side reads tensors from a read-only buffer and copies them at once
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    return torchft


def replica_id_from_env(groups: int) -> int:
    """This process's replica group, from MESHFORMER_REPLICA_ID."""
    fix = (f"start the groups with `meshformer train CONFIG --replica-groups {groups}`, or set {REPLICA_ID_ENV} to "
           f"a number from 0 to {groups - 1} in each group's environment")
    text = os.environ.get(REPLICA_ID_ENV)
    if text is None:
        raise ConfigError(f"fault_tolerance.enabled, but {REPLICA_ID_ENV} is not set", fix)
    if not text.isdigit() or int(text) >= groups:
        raise ConfigError(f"{REPLICA_ID_ENV}={text!r} names no group of fault_tolerance.replica_groups={groups}", fix)
    return int(text)


def lighthouse_address(cfg: FaultToleranceConfig) -> str:
    address = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(f"fault_tolerance.enabled, but no Lighthouse: fault_tolerance.lighthouse and "
                          f"{LIGHTHOUSE_ENV} are empty",
                          "start one with `meshformer lighthouse` and set fault_tolerance.lighthouse to the address "
                          "it prints (`meshformer train --replica-groups N` starts one itself)")
    return address


def start_lighthouse(cfg: FaultToleranceConfig, bind: str = "[::]:0") -> Any:
    """A Lighthouse serving in this process (until `.shutdown()`); `.address()` is what the groups connect to."""
    require_torchft()
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=cfg.min_replicas,
                            join_timeout_ms=round(cfg.join_timeout_s * 1000),
                            heartbeat_timeout_ms=round(cfg.heartbeat_timeout_s * 1000))


@dataclass(frozen=True)
class StepSync:
    """What the cross-group all-reduce of one step gave: its members and their target tokens."""

    replicas: tuple[int, ...]  # the replica groups whose gradients were averaged (empty: the all-reduce failed)
    tokens: float  # target tokens of the step over those groups
    stop: int = 0  # the stop signal a group of the step had agreed on (0: none): every group stops after this step


class ReplicaGroup:
    """This process's side of the run's torchft quorum: one per rank of a replica group."""

    def __init__(self, cfg: FaultToleranceConfig, replica_id: int, device: torch.device,
                 state_dict: Callable[[], dict[str, Any]], load_state_dict: Callable[[dict[str, Any]], None],
                 log: Callable[[str], None]) -> None:
        require_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self.cfg, self.replica_id, self.device, self.log = cfg, replica_id, device, log
        self._load_state_dict = load_state_dict
        self.healed_s: float | None = None  # set by a heal during the last start_step
        self._lighthouse = lighthouse_address(cfg)
        timeout = timedelta(seconds=cfg.timeout_s)
        if dist.is_initialized():  # the group's own store (torchrun's MASTER_ADDR/PORT) joins its ranks' managers
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            rank, world = dist.get_rank(), dist.get_world_size()
        else:  # a group of one process: a store of its own
            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port, rank, world = "127.0.0.1", self._store.port, 0, 1
        self._rank = rank
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._heal, state_dict=state_dict, min_replica_size=cfg.min_replicas,
            use_async_quorum=False,  # a heal lands before the step's batches are read: the healed group trains it
            timeout=timeout, quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
            rank=rank, world_size=world, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=lighthouse_address(cfg) if rank == 0 else None,
            replica_id=f"meshformer_{replica_id}",
            init_sync=False)  # every group starts from the same seeded weights

    def _heal(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        self._load_state_dict(state)
        self.healed_s = time.perf_counter() - start

    def lighthouse_lost(self) -> str:
        """Why the Lighthouse cannot be reached (a fresh connection within fault_tolerance.timeout_s), or "".

        The group's ManagerServer keeps its connection to the Lighthouse, and a Lighthouse that stops listening
        can keep answering on it with the last quorum's members; a new connection is what tells it is gone."""
        address = self._lighthouse.split("://", 1)[-1]
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=self.cfg.timeout_s).close()
        except (OSError, ValueError) as err:
            return f"the Lighthouse at {self._lighthouse} cannot be reached: {err}"
        return ""

    def start_step(self) -> float:
        """Join this step's quorum (and heal from a live peer if behind); returns the seconds it took."""
        start = time.perf_counter()
        self.healed_s = None
        try:
            self.manager.start_quorum()
        except Exception as err:  # the Lighthouse unreachable, or fewer than min_replicas within the timeout
            raise FaultToleranceError(
                f"replica group {self.replica_id} got no quorum within fault_tolerance.quorum_timeout_s="
                f"{self.cfg.quorum_timeout_s:g} ({str(err).splitlines()[0] if str(err) else type(err).__name__})",
                "check that the Lighthouse runs and that at least fault_tolerance.min_replicas groups are up; the "
                "group's launcher restarts it") from None
        return time.perf_counter() - start

    def start_step_or_wait(self, wait_s: float, any_rank: Callable[[bool], bool] = bool,
                           stop_requested: Callable[[], bool] = lambda: False) -> float:
        """`start_step`, asked again while there is no quorum (the Lighthouse unreachable, fewer than min_replicas
        groups), for up to `wait_s` seconds, with one line when the wait starts and one when it ends; raises
        FaultToleranceError once it is over. `any_rank` makes the group's ranks decide together (True where any
        rank's argument is True); `stop_requested` (a stop signal) ends the wait early. Returns the seconds it
        took."""
        start = time.perf_counter()
        failure: FaultToleranceError | None = None
        said = False
        while True:
            lost = self.lighthouse_lost() if self._rank == 0 else ""
            if any_rank(bool(lost)):  # the group's ranks skip the quorum together: it would only time out
                failure, failed = FaultToleranceError(
                    f"replica group {self.replica_id} got no quorum: {lost or 'its rank 0 lost the Lighthouse'}",
                    "start the Lighthouse again at the same address"), True
                time.sleep(min(1.0, wait_s / 10))  # a refused connection fails at once: ask again in a moment
            else:
                try:
                    self.start_step()
                    failed = False
                except FaultToleranceError as err:
                    failure, failed = err, True
            if not any_rank(failed):
                if failure is not None:
                    self.log(f"fault tolerance: replica group {self.replica_id} has a quorum again after "
                             f"{time.perf_counter() - start:.1f}s")
                return time.perf_counter() - start
            if failed and not said:
                said, what = True, failure.what if failure is not None else ""
                limit = f"up to fault_tolerance.wait_s={wait_s:g}s" if wait_s < math.inf else "at start-up"
                self.log(f"fault tolerance: replica group {self.replica_id} has no quorum ({what}); waiting "
                         f"{limit} for the Lighthouse and fault_tolerance.min_replicas={self.cfg.min_replicas} groups")
            # torchft raises a failed quorum again at the next start_quorum: this one is over
            self.manager._quorum_future = None
            if any_rank(time.perf_counter() - start >= wait_s or stop_requested()):
                raise FaultToleranceError(
                    f"replica group {self.replica_id} had no quorum for {time.perf_counter() - start:.0f}s "
                    f"(fault_tolerance.wait_s={wait_s:g})",
                    "start the Lighthouse again (or more replica groups), then the same command resumes from the "
                    "checkpoint; or raise fault_tolerance.wait_s")

    def average_gradients(self, params: Iterable[torch.nn.Parameter], tokens: torch.Tensor, stop: int = 0
                          ) -> StepSync:
        """Average the gradients (this rank's shards) over the replica groups in this step's quorum, weighted by
        each group's target tokens, as one all-reduce; their membership, token total and stop signals (`stop`: the
        one this group agreed on, 0 for none) ride along in it."""
        params = [p for p in params if p.requires_grad]
        groups = self.cfg.replica_groups
        local = [_local(p) for p in params]
        numel = sum(t.numel() for t in local)
        # [gradients | one flag per group | tokens | one stop signal per group]
        flat = torch.zeros(numel + 2 * groups + 1, dtype=torch.float32, device=self.device)
        offset = 0
        for p, t in zip(params, local):
            if p.grad is not None:
                flat[offset:offset + t.numel()].copy_(_local(p.grad).reshape(-1))
            offset += t.numel()
        # Each group's gradients are its summed loss / its tokens: weighting by tokens makes the sum over groups
        # the summed loss of every trained token, divided below by their total.
        flat[:numel].mul_(tokens.to(torch.float32))
        flat[numel + self.replica_id] = 1.0
        flat[numel + groups] = tokens.to(torch.float32)
        flat[numel + groups + 1 + self.replica_id] = float(stop)
        from torch.distributed import ReduceOp

        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return StepSync((), 0.0)
        counts = flat[numel:].tolist()  # one host sync per step
        total = counts[groups]
        flat[:numel].div_(max(total, 1.0))
        offset = 0
        for p, t in zip(params, local):
            averaged = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
            if p.grad is None:  # no gradient here this step, but a peer's batch gave it one
                grad = averaged.to(t.dtype).clone()
                p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride()) if isinstance(p, DTensor) else grad
            else:
                _local(p.grad).copy_(averaged)
        return StepSync(tuple(r for r in range(groups) if round(counts[r]) >= 1), total,
                        round(max(counts[groups + 1:])))

    def members(self) -> tuple[int, ...]:
        """The replica groups in this step's quorum, by an all-reduce of one flag per group (a failed all-reduce:
        empty, and the step's commit vote fails)."""
        return self.members_and_stop().replicas

    def members_and_stop(self, stop: int = 0) -> StepSync:
        """`members`, with the stop signals the groups agreed on (`stop`: this group's, 0 for none) in the same
        all-reduce: its `stop` is one of them where any group agreed to stop."""
        from torch.distributed import ReduceOp

        groups = self.cfg.replica_groups
        flags = torch.zeros(2 * groups, dtype=torch.float32, device=self.device)  # [one flag | one signal] per group
        flags[self.replica_id] = 1.0
        flags[groups + self.replica_id] = float(stop)
        self.manager.allreduce(flags, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            return StepSync((), 0.0)
        values = flags.tolist()
        return StepSync(tuple(r for r in range(groups) if round(values[r]) >= 1), 0.0, round(max(values[groups:])))

    def error(self) -> str:
        """The first line of the error that failed this step's all-reduce, or ""."""
        err = self.manager.errored()
        if err is None:
            return ""
        text = str(err.original_exception)
        return text.splitlines()[0] if text else type(err.original_exception).__name__

    def should_commit(self) -> bool:
        """Whether every rank of this group may apply the step (all-reduce succeeded, enough replicas)."""
        return bool(self.manager.should_commit())

    @property
    def participants(self) -> int:
        return int(self.manager.num_participants())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def outer_optimizer(cfg: FaultToleranceConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: Nesterov SGD on the pseudo-gradient (DiLoCo, arXiv 2311.08105 §2)."""
    return torch.optim.SGD(params, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)


class SemiSync:
    """fault_tolerance.method "local_sgd" / "diloco" on torchft's LocalSGD / DiLoCo: each group steps on its own
    batches, and every `sync_every` steps the groups in the quorum synchronise their weights, either averaged
    (LocalSGD) or moved by an outer Nesterov SGD step on the averaged pseudo-gradient, the weights' change since the
    last synchronisation (DiLoCo). The trainer drives the synchronisation (`sync`, after the quorum of
    `ReplicaGroup.start_step`) instead of torchft's optimizer hooks, so a heal and the quorum stay at a step start.

    DiLoCo keeps the weights of the last synchronisation (on the host) and its outer optimizer's momentum; both go
    to a healing peer through the Manager (torchft registers them), next to the trainer's live state."""

    def __init__(self, cfg: FaultToleranceConfig, group: ReplicaGroup, model_parts: Iterable[torch.nn.Module],
                 optimizer: torch.optim.Optimizer, outer: torch.optim.Optimizer | None = None) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD

        self.cfg, self.group = cfg, group
        self.model = torch.nn.ModuleList(model_parts)  # one module over a pipeline stage's parts
        self.diloco: Any = None
        self.local_sgd: Any = None
        if cfg.method == "diloco":
            # `outer`: one made (and loaded from a checkpoint) before the group, over the same parameters
            self.outer = outer if outer is not None else outer_optimizer(cfg, self.model.parameters())
            # sync_every=1 for torchft: the trainer decides when to synchronise. One all-reduce per tensor: torchft's
            # buckets copy the result back in a callback that its wait() does not wait for.
            self.diloco = DiLoCo(group.manager, [self.model], optimizer, self.outer, sync_every=1)
        elif cfg.method == "local_sgd":
            self.local_sgd = LocalSGD(group.manager, self.model, optimizer, sync_every=cfg.sync_every)
        else:
            raise ConfigError(f"fault_tolerance.method={cfg.method!r} is not a semi-synchronous method",
                              'use "local_sgd" or "diloco" (or "sync" without SemiSync)')

    def anchor(self) -> dict[int, torch.Tensor]:
        """DiLoCo's weights of the last synchronisation (this rank's shards, on the host), by id of their parameter:
        the tensors torchft keeps and sends to a healing peer."""
        fragment = self.diloco._fragments[0]
        return {id(p): fragment.original_parameters[name] for name, p in self.model.named_parameters()}

    def due(self, step: int) -> bool:
        """Whether the step after `step` committed steps starts with a synchronisation."""
        return step % self.cfg.sync_every == 0

    def sync(self) -> bool:
        """After this step's quorum: synchronise the weights over it; False where the group did not commit (LocalSGD
        keeps its own weights, DiLoCo goes back to the last synchronised ones)."""
        if self.diloco is not None:
            fragment = self.diloco._fragments[0]
            fragment.prepare_sync()
            return bool(fragment.perform_sync())  # the commit vote, then the outer step where it passed
        averaged = self.local_sgd._average()  # this rank's shards, averaged over the quorum
        if not self.group.should_commit():
            return False
        with torch.no_grad():
            for p, mean in zip(self.model.parameters(), averaged):
                _local(p).copy_(mean)
        return True

    def cross_group_bytes(self) -> int:
        """Bytes this rank sends into one synchronisation's all-reduce (its shards of every weight)."""
        return sum(_local(p).numel() * _local(p).element_size() for p in self.model.parameters())
