"""Process-group start-up and teardown for a torchrun-launched job, with configurable collective timeouts.

- The parallel layout is validated against WORLD_SIZE *before* the process group exists, so a bad mesh
  fails on every rank with the same ConfigError instead of hanging in a rendezvous or a collective.
- Backend by device: gloo on CPU; on CUDA "cpu:gloo,cuda:nccl" (NCCL for GPU tensors, gloo for the odd
  CPU tensor).
- `parallel.timeout_s` bounds every collective. A stuck collective ends with an error that names it:
  torch's flight recorder (enabled here for every backend, gloo included) keeps the last collectives of
  each process group, and the uncaught-exception hook prints which one this rank was waiting in, with
  the rank, before the traceback reaches torchrun (which forwards every rank's stderr to the user).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from meshformer.config import Config, ConfigError
from meshformer.errors import UsageError
from meshformer.parallel_dims import ParallelDims, validate_parallel

_TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog caught collective operation")
_FLIGHT_RECORDER_ENTRIES = "2000"


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within parallel.timeout_s."""


def env_rank() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment; (0, 0, 1) outside torchrun."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def check_endpoint(host: str, port: str, what: str, fix: str) -> None:
    """`what` (host and port, as the user wrote them) names a port from 1 to 65535 on a host this node resolves:
    torch raises a traceback for a malformed one and retries an unresolvable one until its timeout."""
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UsageError(f"{what} is not HOST:PORT with a port from 1 to 65535", fix)
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:  # socket.gaierror: no such host (or no DNS here)
        raise UsageError(f"{what}: this node cannot resolve {host!r} ({err})", fix) from None


def _check_master_env(world: int) -> None:
    """The env:// rendezvous of a job started without torchrun (torchrun sets both variables itself)."""
    fix = ("set MASTER_ADDR to the rank-0 node's address and MASTER_PORT to a free port, or launch with "
           "`meshformer train --nproc-per-node N` (torchrun sets them)")
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr is None or port is None:
        raise UsageError(f"WORLD_SIZE={world}, but MASTER_ADDR and MASTER_PORT are not both set", fix)
    check_endpoint(addr, port, f"MASTER_ADDR={addr!r} MASTER_PORT={port!r}", fix)


def backend_for(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def job_device(cfg: Config, local_rank: int = 0) -> torch.device:
    """This rank's device from train.device: "auto" and a bare "cuda" pick the local rank's GPU."""
    spec = cfg.train.device
    if spec == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"train.device={spec!r} but no CUDA device is visible; use train.device='cpu' or 'auto'")
    if device.type == "cuda" and device.index is None:
        device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ConfigError(f"train.device={spec!r}: this node has {torch.cuda.device_count()} visible CUDA device(s), "
                          f"so there is no cuda:{device.index}",
                          "use train.device='auto' (the local rank's GPU) or an index below the count")
    return device


def init_distributed(cfg: Config) -> ParallelDims:
    """Validate the layout, then join the process group; returns the validated layout (the trainer's `dims`)."""
    rank, local_rank, world = env_rank()
    device = job_device(cfg, local_rank)
    dims = validate_parallel(cfg, world, device)  # before any process-group work
    if dist.is_initialized():
        return dims
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", _FLIGHT_RECORDER_ENTRIES)  # names a stuck collective
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun's agent hands its ranks a checked store
        _check_master_env(world)
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=cfg.parallel.timeout_s))
    install_error_hook(rank, world)
    return dims


def shutdown_distributed(timeout_s: float = 60.0) -> None:
    """Barrier, then destroy the process group (gloo sometimes aborts at exit without the barrier)."""
    if not dist.is_initialized():
        return
    failing = sys.exc_info()[0] is not None  # called from a `finally` while an error propagates
    try:
        if not failing:  # a failed rank leaves at once, so its peers see "connection closed", not a hang
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))  # names ranks that never arrive
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- diagnosing hangs


def is_timeout(err: BaseException) -> bool:
    text = str(err).lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS)


def last_collectives(limit: int = 3) -> list[dict]:
    """The most recent collectives this rank issued (flight recorder), newest last."""
    try:
        # A private binding (no stub); absent from some builds, hence the broad except below.
        from torch._C._distributed_c10d import _dump_fr_trace_json  # type: ignore[attr-defined]

        trace = json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # recorder unavailable or disabled: nothing to add
        return []
    return trace.get("entries", [])[-limit:]


def describe_stuck_collective(err: BaseException, rank: int | None = None) -> str | None:
    """One line naming the collective a timed-out rank was waiting in, or None when `err` is no timeout."""
    if not is_timeout(err):
        return None
    rank = dist.get_rank() if rank is None and dist.is_initialized() else rank
    entries = last_collectives()
    if not entries:
        return f"rank {rank}: a collective timed out ({err}); set TORCH_FR_BUFFER_SIZE to record which one"
    last = entries[-1]
    group = last.get("process_group", ["?", "?"])
    return (f"rank {rank}: collective {last.get('profiling_name', '?')} (sequence #{last.get('collective_seq_id')}, "
            f"process group {group[-1]!r}, input sizes {last.get('input_sizes')}) did not complete within "
            f"{last.get('timeout_ms', 0) / 1000:.0f}s; the other ranks of that group never joined it (one may have "
            "failed or be waiting in a different collective) — raise parallel.timeout_s if it is merely slow")


def install_error_hook(rank: int, world: int) -> None:
    """Uncaught exceptions are printed with this rank's number and, for timeouts, the stuck collective."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        stuck = describe_stuck_collective(exc, rank) if isinstance(exc, Exception) else None
        header = f"[rank {rank}/{world}] uncaught {exc_type.__name__}" + (f": {stuck}" if stuck else "")
        print(header, file=sys.stderr, flush=True)
        if previous is not sys.__excepthook__:
            previous(exc_type, exc, tb)  # torch's own hook already prefixes each line with [rankN]
            return
        for chunk in traceback.format_exception(exc_type, exc, tb):
            for line in chunk.rstrip("\n").split("\n"):
                print(f"[rank {rank}] {line}", file=sys.stderr)
        sys.stderr.flush()

    sys.excepthook = hook
