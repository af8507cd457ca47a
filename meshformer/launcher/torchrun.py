"""`meshformer train CONFIG --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT]` starts torchrun for the user.

Single node: `torchrun --standalone` (a free local port, no endpoint to pick). Several nodes: the c10d
rendezvous, run the same command on every node with the first node's address as the endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshformer.errors import (
    AGENT_REPORTS_ENV,
    PEER_LOST_MARKER,
    REPORTED_MARKER,
    STOP_SIGNALS,
    MeshformerError,
    UsageError,
    peer_lost_line,
)

MAX_WORLD_SIZE = 2**18  # ranks: twice today's largest training jobs (and a plan in under a minute); more is a typo
MAX_RANKS_PER_NODE = 1024  # processes one node starts: beyond any node's GPUs or cores
# `python -m` puts the current folder first on sys.path, where a `torch.py` or `meshformer.py` of the user's would
# shadow the module of that name: the agent and the ranks start with -P (Python's safe path), PYTHONPATH still read.
SAFE_PYTHON = [sys.executable, "-P"]
# torchrun's agent as `run_agent` runs it (this module's main): stop signals, exit statuses, one-line failures
TORCHRUN = [*SAFE_PYTHON, "-m", "meshformer.launcher.torchrun"]
# The agent forwards these to the ranks: the stop signals (save, then exit 128+signal) and SIGQUIT (exit at once).
_AGENT_SIGNALS = (*STOP_SIGNALS, signal.SIGQUIT)
AGENT_SIGNAL_NAMES = ",".join(sig.name for sig in _AGENT_SIGNALS)  # torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE
_STOP_GRACE_BASE_S = 60  # the step in progress and the save's fixed costs
CHECKPOINT_WRITE_BYTES_PER_S = 500e6  # per node, a conservative parallel-filesystem write rate


class LaunchError(MeshformerError, RuntimeError):
    """A rank that died without saying why (a signal: out of memory, killed), or a rendezvous that failed."""


def check_launch_options(nproc_per_node: int, nnodes: int, max_restarts: int) -> None:
    if nproc_per_node < 1 or nnodes < 1 or max_restarts < 0:
        raise UsageError(f"--nproc-per-node={nproc_per_node}, --nnodes={nnodes}, --max-restarts={max_restarts}: "
                         "out of range", "use --nproc-per-node >= 1, --nnodes >= 1 and --max-restarts >= 0")
    if nproc_per_node > MAX_RANKS_PER_NODE:
        raise UsageError(f"--nproc-per-node={nproc_per_node} would start that many processes on this node",
                         f"use at most {MAX_RANKS_PER_NODE}, usually one per GPU")
    check_world_size(nproc_per_node * nnodes, "--nproc-per-node x --nnodes")


def check_world_size(world_size: int, option: str) -> None:
    """A world of ranks we can plan and launch: positive and at most MAX_WORLD_SIZE (refused before allocating)."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"{option} gives {world_size} ranks", f"use a number of ranks from 1 to {MAX_WORLD_SIZE:,}")


def check_rdzv_endpoint(endpoint: str) -> None:
    """--rdzv-endpoint as HOST:PORT ([IPv6]:PORT) with a name this node resolves."""
    from meshformer.runtime.distributed import check_endpoint

    host, _, port = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    check_endpoint(host, port, f"--rdzv-endpoint={endpoint!r}",
                   "pass the first node's address and a free port, e.g. --rdzv-endpoint node0:29500")


def torchrun_command(
    config: str,
    overrides: list[str] | None = None,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: str = "127.0.0.1:29500",
    rdzv_id: str = "meshformer",
    max_restarts: int = 0,
) -> list[str]:
    """The torchrun command line (`python -P -m meshformer.launcher.torchrun ... --no-python python -P -u -m
    meshformer.train CONFIG`)."""
    check_launch_options(nproc_per_node, nnodes, max_restarts)
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    # torchrun's own `-m` starts `python -u -m`: the ranks' interpreter is given whole instead, to add -P
    cmd += ["--no-python", *SAFE_PYTHON, "-u", "-m", "meshformer.train", config]
    if overrides:
        cmd += ["--set", *overrides]
    return cmd


def stop_grace_s(checkpoint_stop_grace_s: float, total_params: int, nnodes: int) -> int:
    """Seconds the launcher gives the ranks, after a stop signal, to finish their step and save before it kills
    them: checkpoint.stop_grace_s, or (0) a base plus the checkpoint's bytes per node (fp32 weights and AdamW's two
    moments) at a conservative write rate."""
    if checkpoint_stop_grace_s > 0:
        return max(1, math.ceil(checkpoint_stop_grace_s))
    return _STOP_GRACE_BASE_S + math.ceil(checkpoint_write_s(total_params, nnodes))


def checkpoint_write_s(total_params: int, nnodes: int) -> float:
    """Seconds to write a checkpoint (fp32 weights and AdamW's two moments: 12 bytes a parameter), every node
    writing its share at the conservative per-node rate."""
    return 12 * total_params / max(1, nnodes) / CHECKPOINT_WRITE_BYTES_PER_S


def torchrun_env(nproc_per_node: int, grace_s: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The agent's handlers: the stop signals too (SLURM's --signal), each forwarded to the ranks.
    env["PET_SIGNALS_TO_HANDLE"] = env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = AGENT_SIGNAL_NAMES  # option, older torch
    if grace_s is not None:  # from a stop signal to SIGKILL: time for the ranks to save (torch's default is 30 s)
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(grace_s)
    # torchrun would set 1 thread per process with a warning; share this node's cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    # Elastic restarts in torch 2.13 fail (gloo connectFullMesh refused or a hang) without it (pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class _AgentSignals:
    """The agent's signal handler, in place of torch's for the duration of a launch.

    The first signal goes to torch's handler: the agent forwards it to the ranks, which finish their step, save
    and exit, and waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT). A repeat within REPEAT_WINDOW_S is the same
    request (a terminal signals the whole process group, so the ranks got it directly as well). A later signal is
    passed on to the ranks, which then stop at once, while the agent goes on waiting for them to exit, so that no
    rank is left behind as an orphan.
    """

    def __init__(self, torch_handler: Any) -> None:
        self.torch_handler = torch_handler
        self.first: tuple[int, float] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        from meshformer.runtime.stop import REPEAT_WINDOW_S

        now = time.monotonic()
        if self.first is None:
            self.first = (signum, now)
            self.torch_handler(signum, frame)  # raises torch's SignalException: the agent's shutdown path
            return
        if now - self.first[1] < REPEAT_WINDOW_S:
            return
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    @property
    def exit_status(self) -> int:
        return 128 + (self.first[0] if self.first is not None else signal.SIGTERM)


def _child_pids() -> list[int]:
    """This process's children (the ranks), from /proc; empty where /proc has no such list."""
    pids = []
    for children in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(pid) for pid in children.read_text().split()]
    return pids


def launch_torchrun(config: str, overrides: list[str] | None = None, *, nproc_per_node: int,
                    grace_s: int | None = None, **options: Any) -> int:
    """Run torchrun's agent in this process (`options` as for `torchrun_command`); returns the exit status.

    A failed rank ends as one line, not torchrun's failure report: the line the ranks printed (a rank that
    reports leaves a marker in the agent's attempt folder, see meshformer.errors), or a LaunchError naming the
    rank that died without one. A stop signal (to this process, the ranks, or both) ends with every rank's
    checkpoint committed and the status 128+signal; `grace_s` bounds the wait for the ranks to save.
    """
    cmd = torchrun_command(config, overrides, nproc_per_node=nproc_per_node, **options)
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.environ.update(torchrun_env(nproc_per_node, grace_s))
    return run_agent(cmd[len(TORCHRUN):])


def run_agent(torchrun_args: list[str]) -> int:
    """torchrun's agent in this process, given torchrun's own options (and the command it starts on every rank);
    returns the exit status, as `launch_torchrun` describes. A SLURM job's nodes run it as this module's main."""
    import torch.distributed.elastic.multiprocessing.api as elastic_processes
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", AGENT_SIGNAL_NAMES)  # torchrun's --signals-to-handle
    os.environ[AGENT_REPORTS_ENV] = "1"  # a rank that loses a peer leaves the line to this agent (it sees signals)
    agent_signals = _AgentSignals(elastic_processes._terminate_process_handler)
    with tempfile.TemporaryDirectory(prefix="meshformer-torchrun-") as log_dir:
        args = parse_args([f"--log-dir={log_dir}", *torchrun_args])
        logging.disable(logging.CRITICAL)  # the agent's own log repeats each failure in many lines
        handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}  # the agent replaces them: put them back
        elastic_processes._terminate_process_handler = agent_signals  # type: ignore[assignment]
        try:
            run(args)
        except ChildFailedError as err:
            stopped = {failure.exitcode for failure in err.failures.values()}
            if stopped <= {128 + sig for sig in STOP_SIGNALS}:  # the ranks got a stop signal directly and saved
                return max(stopped)
            if not any(Path(log_dir).rglob(REPORTED_MARKER)):
                raise LaunchError(*_unreported_failure(err.failures, any(Path(log_dir).rglob(PEER_LOST_MARKER)))
                                  ) from None
            return 1
        except RendezvousError as err:
            raise LaunchError(f"the ranks could not meet ({err})",
                              "check --rdzv-endpoint and that every node runs the same command") from None
        except KeyboardInterrupt:
            return 130
        except SignalException:  # Ctrl-C or a scheduler's SIGTERM: the agent stopped the ranks (they saved)
            return agent_signals.exit_status
        finally:
            elastic_processes._terminate_process_handler = agent_signals.torch_handler
            logging.disable(logging.NOTSET)
            for sig, handler in handlers.items():
                if handler is not None:  # None: installed outside Python, nothing to restore
                    signal.signal(sig, handler)
    return 0


def _unreported_failure(failures: dict[int, Any], peer_lost: bool = False) -> tuple[str, str]:
    """(what, fix) for the first rank that failed without printing an error line: a signal first. `peer_lost`:
    ranks of this node stopped because a peer ended (they leave the line to the agent)."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp))
    where = f"rank {rank} (pid {failure.pid})"
    if failure.exitcode < 0:
        signum = -failure.exitcode
        fix = ("SIGKILL is usually the out-of-memory killer, out of host memory? see `dmesg` on its node; lower "
               "data.batch_size or --nproc-per-node" if signum == signal.SIGKILL
               else "its output above shows what it was doing")
        return f"{where} was killed by {failure.signal_name()} (signal {signum}) before it could report an error", fix
    if peer_lost:  # the peer is on another node: its agent names what ended it
        what, _, fix = peer_lost_line(rank).partition(" — ")
        return what, fix
    return f"{where} exited with status {failure.exitcode}", "its output above says why"


def main(argv: list[str] | None = None) -> None:
    """`python -m meshformer.launcher.torchrun [torchrun options] -m meshformer.train CONFIG [--set ...]`; with
    `--standby` first, it imports torchrun's agent, then waits for a line on stdin: `go` runs the rest of the command
    line, anything else (or the end of stdin) exits at once (a replica group's spare agent, launcher/replica_groups.py).
    """
    from meshformer.errors import run_command

    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [STANDBY]:
        import torch.distributed.run  # noqa: F401  # the agent's imports: the seconds a standby saves a restart

        from meshformer.launcher.warm_rank import adopt_warm_ranks, start_warm_ranks

        warm = start_warm_ranks(_nproc_per_node(args))  # and the ranks' imports, done beside it
        if sys.stdin.readline().strip() != "go":
            _exit_now(0)  # the warm ranks follow their parent (they die with it)
        adopt_warm_ranks(warm)
        args = args[1:]
    try:
        status = run_command(run_agent, args)
    except SystemExit as done:
        _exit_now(done.code)
    _exit_now(status)


STANDBY = "--standby"


def _nproc_per_node(torchrun_args: list[str]) -> int:
    """torchrun's --nproc-per-node as `torchrun_command` writes it (0 where it is not a number)."""
    for arg in torchrun_args:
        name, _, value = arg.partition("=")
        if name == "--nproc-per-node":
            return int(value) if value.isdigit() else 0
    return 0


def _exit_now(code: object) -> None:
    """Exit as SystemExit(code) would, without the interpreter's teardown: the agent has nothing left to clean up
    (its ranks have exited, its temporary folder is gone), and torch's teardown takes seconds on a busy machine,
    seconds a replica group's launcher would wait before it restarts a failed group."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":
    main()
