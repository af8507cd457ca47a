"""`meshformer train CONFIG --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT]` starts torchrun for the user.

Single node: `torchrun --standalone` (a free local port, no endpoint to pick). Several nodes: the c10d
rendezvous, run the same command on every node with the first node's address as the endpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshformer.errors import REPORTED_MARKER, MeshformerError, UsageError

MAX_WORLD_SIZE = 2**18  # ranks: twice today's largest training jobs (and a plan in under a minute); more is a typo
MAX_RANKS_PER_NODE = 1024  # processes one node starts: beyond any node's GPUs or cores
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's agent handles these


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
    """The torchrun command line (`python -m torch.distributed.run ... -m meshformer.train CONFIG`)."""
    check_launch_options(nproc_per_node, nnodes, max_restarts)
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}",
                f"--rdzv-id={rdzv_id}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "meshformer.train", config]
    if overrides:
        cmd += ["--set", *overrides]
    return cmd


def torchrun_env(nproc_per_node: int) -> dict[str, str]:
    env = dict(os.environ)
    # torchrun would set 1 thread per process with a warning; share this node's cores instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    # Elastic restarts in torch 2.13 fail (gloo connectFullMesh refused or a hang) without it (pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def launch_torchrun(config: str, overrides: list[str] | None = None, *, nproc_per_node: int, **options: Any) -> int:
    """Run torchrun's agent in this process (`options` as for `torchrun_command`); returns the exit status.

    A failed rank ends as one line, not torchrun's failure report: the line the ranks printed (a rank that
    reports leaves a marker in the agent's attempt folder, see meshformer.errors), or a LaunchError naming the
    rank that died without one.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    cmd = torchrun_command(config, overrides, nproc_per_node=nproc_per_node, **options)
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.environ.update(torchrun_env(nproc_per_node))
    with tempfile.TemporaryDirectory(prefix="meshformer-torchrun-") as log_dir:
        args = parse_args([f"--log-dir={log_dir}", *cmd[len(TORCHRUN):]])
        logging.disable(logging.CRITICAL)  # the agent's own log repeats each failure in many lines
        handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}  # the agent replaces them: put them back
        try:
            run(args)
        except ChildFailedError as err:
            if not any(Path(log_dir).rglob(REPORTED_MARKER)):
                raise LaunchError(*_unreported_failure(err.failures)) from None
            return 1
        except RendezvousError as err:
            raise LaunchError(f"the ranks could not meet ({err})",
                              "check --rdzv-endpoint and that every node runs the same command") from None
        except KeyboardInterrupt:
            return 130
        except SignalException as err:  # Ctrl-C or a scheduler's SIGTERM: the agent stopped the ranks
            return 128 + int(err.sigval)
        finally:
            logging.disable(logging.NOTSET)
            for sig, handler in handlers.items():
                if handler is not None:  # None: installed outside Python, nothing to restore
                    signal.signal(sig, handler)
    return 0


def _unreported_failure(failures: dict[int, Any]) -> tuple[str, str]:
    """(what, fix) for the first rank that failed without printing an error line: a signal first."""
    rank, failure = min(failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp))
    where = f"rank {rank} (pid {failure.pid})"
    if failure.exitcode < 0:
        name = failure.signal_name()
        fix = ("SIGKILL is usually the out-of-memory killer (see `dmesg`): lower data.batch_size or --nproc-per-node"
               if -failure.exitcode == signal.SIGKILL else "its output above shows what it was doing")
        return f"{where} was killed by {name} before it could report an error", fix
    return f"{where} exited with status {failure.exitcode}", "its output above says why"
