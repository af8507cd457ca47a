"""`meshformer train CONFIG --replica-groups N --nproc-per-node K`: a Lighthouse and N replica groups on this machine.

Each group is its own torchrun job (K processes, `--standalone`: a port of its own) with `MESHFORMER_REPLICA_ID=r`
and the Lighthouse's address (`TORCHFT_LIGHTHOUSE`) in its environment. A group that fails is started again,
and heals from a live peer at its first step (meshformer/train/replica_step.py); the others train on. Once a
group has finished the run, a failed group is no longer restarted (nothing is left to heal from). A stop signal
goes to every group, which saves and exits as a single job does; nothing restarts after it.

Each group has a standby agent: a torchrun agent process with its imports done, waiting for a line on stdin
(`meshformer.launcher.torchrun --standby`). A restart hands the group's command to it instead of starting a new
interpreter, which saves the agent's start-up (seconds: torch's imports) on the way back into the quorum. It is
started once the group has committed a step (its record grew), so that it does not compete with the group's own
start-up for the cores, and a group that fails before then restarts with a fresh agent.

`meshformer lighthouse` runs the Lighthouse alone, for groups started by hand or by a scheduler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshformer.config import Config
from meshformer.errors import STOP_SIGNALS, UsageError
from meshformer.launcher.torchrun import STANDBY, TORCHRUN, torchrun_command, torchrun_env
from meshformer.runtime.fault_tolerance import LIGHTHOUSE_ENV, REPLICA_ID_ENV, start_lighthouse

MAX_REPLICA_GROUPS = 1024
_POLL_S = 0.1
# torchrun's wait between a rank's failure and SIGKILL of the group's other ranks: a rank waiting for a dead peer of
# its own group keeps the group heartbeating, and the Lighthouse waits for a heartbeating group before it gives the
# others a quorum without it
GROUP_SHUTDOWN_S = 2
FINISH_GRACE_S = 60.0  # a restarted group still running this long after another group finished the run is stopped
RECORD = "replicas.jsonl"  # each group's record in <run_dir>/replica-<r>/ (meshformer/train/replica_step.py)


def replica_overrides(groups: int) -> list[str]:
    """What `--replica-groups N` sets in the config of every group."""
    return ["fault_tolerance.enabled=true", f"fault_tolerance.replica_groups={groups}"]


def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES names them (all of them when it is unset)."""
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return [d for d in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def group_gpus(replica_id: int, nproc_per_node: int, groups: int, visible: list[str]) -> str | None:
    """CUDA_VISIBLE_DEVICES of group `replica_id`: its own nproc_per_node GPUs when the machine has one for every
    rank of every group (each group's local rank k would otherwise take the same cuda:k as the others', which NCCL
    refuses); None, to leave the environment as it is, when there are fewer."""
    if len(visible) < groups * nproc_per_node:
        return None
    return ",".join(visible[replica_id * nproc_per_node:(replica_id + 1) * nproc_per_node])


def check_replica_groups(groups: int) -> None:
    if not 1 <= groups <= MAX_REPLICA_GROUPS:
        raise UsageError(f"--replica-groups={groups} is out of range",
                         f"use from 1 to {MAX_REPLICA_GROUPS} groups (2 or more to survive a failed one)")


@dataclass
class _Group:
    replica_id: int
    process: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    status: int | None = None  # the exit status it ended with (0: trained to train.steps)
    history: list[int] = field(default_factory=list)  # exit statuses of its failed runs
    standby: subprocess.Popen | None = None  # its spare agent, imports done, waiting for "go" on stdin
    record_size: int = -1  # the size of its record when it (re)started (-1: the standby is started or not wanted)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def launch_replica_groups(config: str, overrides: list[str], cfg: Config, *, nproc_per_node: int,
                          max_restarts: int = 100) -> int:
    """Run the Lighthouse in this process and the groups as child processes until every group has finished or
    stopped; returns the exit status (0: the run reached train.steps)."""
    ft = cfg.fault_tolerance
    lighthouse = start_lighthouse(ft)
    address = lighthouse.address()
    print(f"lighthouse: {address} (min_replicas {ft.min_replicas}, heartbeat timeout {ft.heartbeat_timeout_s:g}s, "
          f"join timeout {ft.join_timeout_s:g}s)", file=sys.stderr, flush=True)
    command = torchrun_command(config, overrides, nproc_per_node=nproc_per_node)
    groups = [_Group(r) for r in range(ft.replica_groups)]
    stopping: list[int] = []
    finished_at: list[float] = []

    def on_signal(signum: int, frame: Any) -> None:
        # To the ranks themselves: each finishes its step, saves and exits (their agents would give them only
        # GROUP_SHUTDOWN_S to do so)
        stopping.append(signum)
        for group in groups:
            if group.running:
                _signal_ranks(group, signum)

    def group_env(group: _Group) -> dict[str, str]:
        # the machine's cores shared by every group's ranks (OMP threads), not by one group's
        env = {**torchrun_env(len(groups) * nproc_per_node, GROUP_SHUTDOWN_S), REPLICA_ID_ENV: str(group.replica_id),
               LIGHTHOUSE_ENV: address}
        gpus = group_gpus(group.replica_id, nproc_per_node, len(groups), visible_gpus())
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def start(group: _Group) -> None:
        group.process = _wake(group.standby)
        group.standby = None
        if group.process is None:
            # a session of its own: a terminal's Ctrl-C reaches the launcher, which passes it on (above)
            group.process = subprocess.Popen(command, env=group_env(group), start_new_session=True)
        group.started = time.monotonic()
        group.record_size = _size(record(group))

    def record(group: _Group) -> Path:
        return Path(cfg.logging.run_dir) / f"replica-{group.replica_id}" / RECORD

    def start_standby(group: _Group) -> None:
        group.record_size = -1
        group.standby = subprocess.Popen([*TORCHRUN, STANDBY, *command[len(TORCHRUN):]], env=group_env(group),
                                         stdin=subprocess.PIPE, start_new_session=True)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        for group in groups:
            start(group)
        while any(group.status is None for group in groups):
            time.sleep(_POLL_S)
            for group in groups:
                if group.status is not None or group.process is None:
                    continue
                status = group.process.poll()
                if status is None and group.record_size >= 0 and not (stopping or finished_at) and \
                        group.restarts < max_restarts and _size(record(group)) > group.record_size:
                    start_standby(group)  # the group committed a step: its start-up is over
                if status is None:
                    if finished_at and group.restarts and time.monotonic() - finished_at[0] > FINISH_GRACE_S:
                        # restarted after the others had gone on without it, and never caught up: nothing is left
                        # to heal from, and training alone from its own state would be another run
                        print(f"replica group {group.replica_id} still trains {FINISH_GRACE_S:g}s after the run "
                              "reached train.steps in another group: stopped", file=sys.stderr, flush=True)
                        _kill_tree(group.process.pid)
                    continue
                if status == 0:
                    finished_at.append(time.monotonic())
                if status == 0 or stopping or finished_at or group.restarts >= max_restarts:
                    group.status = status
                    if status != 0:
                        why = "stopping" if stopping else "the run reached train.steps in another group" \
                            if finished_at else f"{max_restarts} restarts"
                        print(f"replica group {group.replica_id} exited with status {status}; not restarted ({why})",
                              file=sys.stderr, flush=True)
                    continue
                group.history.append(status)
                group.restarts += 1
                standby = ", on its standby agent" if group.standby is not None else ""
                print(f"replica group {group.replica_id} exited with status {status} after "
                      f"{time.monotonic() - group.started:.1f}s; restarting it (restart {group.restarts}{standby}): it "
                      "heals from a live peer", file=sys.stderr, flush=True)
                start(group)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for group in groups:
            _dismiss(group.standby)
            if group.running:
                assert group.process is not None
                _kill_tree(group.process.pid)
                group.process.wait()
        lighthouse.shutdown()
    if stopping:
        return 128 + stopping[0]
    return 0 if finished_at else max(group.status or 1 for group in groups)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _wake(standby: subprocess.Popen | None) -> subprocess.Popen | None:
    """The standby agent, told to run the group's command (None where there is none, or it has died)."""
    if standby is None or standby.stdin is None or standby.poll() is not None:
        return None
    try:
        standby.stdin.write(b"go\n")
        standby.stdin.close()
    except OSError:  # it died in between
        _dismiss(standby)
        return None
    return standby


def _dismiss(standby: subprocess.Popen | None) -> None:
    """End a standby agent that was not needed (it holds nothing but its imports)."""
    if standby is None:
        return
    _kill_tree(standby.pid)
    standby.wait()
    with contextlib.suppress(OSError):
        if standby.stdin is not None:
            standby.stdin.close()


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            found += [int(child) for child in children.read_text().split()]
    return found


def _signal_ranks(group: _Group, signum: int) -> None:
    """`signum` to the ranks of a group (the children of its torchrun agent)."""
    assert group.process is not None
    for pid in _children(group.process.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _kill_tree(pid: int) -> None:
    for child in _children(pid):
        _kill_tree(child)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def serve_lighthouse(cfg: Config, bind: str) -> None:
    """`meshformer lighthouse`: serve until a stop signal."""
    ft = cfg.fault_tolerance
    lighthouse = start_lighthouse(ft, bind)
    print(f"lighthouse: {lighthouse.address()} (min_replicas {ft.min_replicas}); set fault_tolerance.lighthouse="
          f"\"{lighthouse.address()}\" (or {LIGHTHOUSE_ENV}) in every replica group", flush=True)
    stopped: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stopped.append(signum)) for sig in STOP_SIGNALS}
    try:
        while not stopped:
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lighthouse.shutdown()

