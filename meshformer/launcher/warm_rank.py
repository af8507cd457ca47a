"""A replica group's restart hands each rank to a warm rank, an interpreter whose imports are already done.

A restarted group spends most of its way back into the quorum starting its ranks' interpreters: torch, torchft and
meshformer's imports take seconds, more on a machine whose cores the surviving groups keep busy. The group's standby
agent (launcher/replica_groups.py) therefore starts one warm rank per local rank beside itself: an interpreter that
imports what a rank imports, then waits on its stdin. When the standby agent takes over the restart, torchrun's
worker start is replaced for the ranks' command (`python -P -u -m meshformer.train ...`): instead of a new process,
the warm rank of that local rank gets the rank's arguments and environment as one JSON line, and runs them as
`python -m meshformer.train` would. It is the agent's own child in a session of its own, as torchrun's worker would be,
so torchrun watches, signals and reaps it unchanged. Its `/proc/PID/comm` names the rank it became (`rank<N>`, as the
environment it started with predates its RANK).

Anything else (another command, a NUMA binding, a warm rank that died) starts the worker the usual way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from typing import Any

# what the ranks' command starts with after the interpreter (launcher/torchrun.py `torchrun_command`)
RANK_COMMAND = ("-P", "-u", "-m", "meshformer.train")
WARM_MODULE = "meshformer.launcher.warm_rank"
# what a rank imports before its first step (meshformer/train/__main__.py's `run`, the process group, torchft)
WARM_IMPORTS = ("torchft", "meshformer.checkpointing.init_from", "meshformer.runtime.distributed",
                "meshformer.train.__main__", "meshformer.train.preflight", "meshformer.train.trainer")


def start_warm_ranks(nproc_per_node: int) -> list[subprocess.Popen]:
    """One waiting interpreter per local rank, children of this (agent) process, with its environment."""
    return [subprocess.Popen([sys.executable, *RANK_COMMAND[:2], "-m", WARM_MODULE], stdin=subprocess.PIPE,
                             start_new_session=True) for _ in range(nproc_per_node)]


def adopt_warm_ranks(warm: list[subprocess.Popen]) -> None:
    """Make torchrun's worker start hand local rank k to `warm[k]` (once each) where it can."""
    import torch.distributed.elastic.multiprocessing.api as elastic_api

    spare = dict(enumerate(warm))
    start_usual = elastic_api.get_subprocess_handler

    def get_subprocess_handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: str, stderr: str,
                               local_rank_id: int, numa_options: Any = None) -> Any:
        process = spare.pop(local_rank_id, None)
        ranks_command = entrypoint == sys.executable and tuple(map(str, args[:len(RANK_COMMAND)])) == RANK_COMMAND
        argv = [str(a) for a in args[len(RANK_COMMAND):]]
        if process is not None and numa_options is None and ranks_command and \
                _hand_over(process, argv, {**os.environ, **env}, stdout, stderr):
            return _Adopted(process, local_rank_id)
        if process is not None:
            _end(process)
        return start_usual(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                           local_rank_id=local_rank_id, numa_options=numa_options)

    elastic_api.get_subprocess_handler = get_subprocess_handler  # type: ignore[assignment]


class _Adopted:
    """torchrun's SubprocessHandler for a warm rank: the same `proc`, `local_rank_id` and `close`."""

    def __init__(self, process: subprocess.Popen, local_rank_id: int) -> None:
        self.proc = process
        self.local_rank_id = local_rank_id

    def close(self, death_sig: signal.Signals | None = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)


def _hand_over(process: subprocess.Popen, argv: list[str], env: dict[str, str], stdout: str | None,
               stderr: str | None) -> bool:
    if process.poll() is not None or process.stdin is None:
        return False
    try:
        process.stdin.write((json.dumps({"argv": argv, "env": env, "stdout": stdout or None,
                                         "stderr": stderr or None}) + "\n").encode())
        process.stdin.close()
    except OSError:  # it died in between
        return False
    return True


def process_rank(pid: int) -> int | None:
    """The global rank process `pid` runs (its RANK, or the name a warm rank took); None for any other process."""
    from pathlib import Path

    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    env = dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)
    rank = env.get("RANK") or (name[len("rank"):] if name.startswith("rank") else "")
    return int(rank) if rank.isdigit() else None


def _end(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _name_process(name: str) -> None:
    """This process's name in /proc/PID/comm and `ps` (Linux; elsewhere nothing)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


def _redirect(path: str | None, fd: int) -> None:
    if path:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def main() -> None:
    """A warm rank: import, wait for the rank's arguments on stdin, then be that rank (nothing on stdin: exit)."""
    from meshformer.runtime.stop import die_with_parent

    die_with_parent()  # a standby agent that is dismissed or killed takes its warm ranks along
    import importlib
    import runpy

    import torch

    for module in WARM_IMPORTS:  # by name, as the ranks' command names the module it runs
        importlib.import_module(module)

    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)
    rank = json.loads(line)
    os.environ.clear()
    os.environ.update(rank["env"])
    _name_process(f"rank{os.environ.get('RANK', '')}")
    _redirect(rank["stdout"], 1)
    _redirect(rank["stderr"], 2)
    if "OMP_NUM_THREADS" in os.environ:  # read by torch at its import, before this rank's environment was known
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = ["-m", *rank["argv"]]
    runpy.run_module(RANK_COMMAND[-1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
