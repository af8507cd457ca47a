"""Stopping a job on a signal: all ranks finish the same step, commit a checkpoint, and exit with 128+signal.

Whatever receives the signal — the launcher (which forwards it), every rank, the whole process group, SLURM's
`--signal` — the request is one flag per rank. Each step, the ranks all-reduce their flags asynchronously on a gloo
group of their own and read the result one step later: no host synchronisation on the hot path, and every rank
reads the same value after the same step, so all of them stop there.

Long phases between two steps (held-out evaluation, downstream scoring, decoded samples, the `--init-from` load,
the final weights) call `poll()` once per batch (token, tensor): the same exchange, one per call and read at the
next, so a stop is agreed within a batch of the signal and every rank leaves the phase after the same batch (their
forward passes and collectives stay paired). `check_now()` is the blocking form, for the set-up before the first
step, where no work overlaps the exchange. Either raises `StopAgreed`, which the trainer turns into the stop's save.

The same request often arrives twice within moments (a terminal's Ctrl-C reaches every process of the group, and
the launcher forwards it once more); a repeat within `REPEAT_WINDOW_S` is that same request. A later one means
"stop now": the process exits at once without saving, which leaves the last committed checkpoint as it was (a save
in progress only ever wrote into its `.partial` folder). Once the stop's checkpoint is committed, further signals
are ignored: the process is already on its way out.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from meshformer.errors import STOP_SIGNALS

REPEAT_WINDOW_S = 2.0  # the same request delivered twice (process group + launcher), not a second one
_log = logging.getLogger("meshformer.stop")


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by a signal, which a stopped run exits with after saving."""
    return 128 + signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def die_with_parent() -> None:
    """A rank whose launcher is killed (even with SIGKILL) gets SIGTERM: it stops with a checkpoint instead of
    training on as an orphan (Linux; elsewhere nothing is set)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the request was in place
        os.kill(os.getpid(), signal.SIGTERM)


def _under_agent() -> bool:
    """Whether torchrun's agent started this process (a rank of a launched job, not a library user's process)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopAgreed(BaseException):
    """Every rank agreed to stop inside a phase: the phase is left at once (a BaseException, so that no `except
    Exception` between the phase and the trainer takes it for a failure)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class StopRequest:
    """The stop flag of this rank and the agreement of all ranks on the step to stop after.

    stop = StopRequest(log=...)         # every rank, collectively (creates its gloo group)
    stop.install()                      # handlers for STOP_SIGNALS (main thread only)
    ... each step: if stop.agreed(step): save; stop.saved(); break
    ... each batch of a long phase: stop.poll()  # raises StopAgreed (every rank at the same call)
    stop.close()                        # waits for the exchange in flight, puts the old handlers back
    """

    def __init__(self, *, every: int = 1, log: Callable[[str], Any] | None = None,
                 on_stop_now: Callable[[], Any] | None = None) -> None:
        self.every = max(1, every)
        self.log = log or _log.info
        self.on_stop_now = on_stop_now  # last words before a "stop now" exit (e.g. flush the metrics file)
        self.signum: int | None = None
        self._first_at = 0.0
        self._saved = False
        self._handlers: dict[int, Any] = {}
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # A gloo group of its own: a CPU flag, no device sync, and no ordering against the training collectives or the
        # checkpoint thread's.
        self._group = dist.new_group(backend="gloo") if self.distributed else None
        self._flag: torch.Tensor | None = None
        self._work: Any = None
        self.stopping = False  # every rank agreed to stop (sticky: later checks all answer yes)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal(self) -> str:
        return signal_name(self.signum) if self.signum is not None else ""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._handlers = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            self.log(f"{signal_name(signum)} received: finishing this step, saving a checkpoint, then stopping "
                     f"(signal again to stop at once, without saving)")
            return
        if self._saved or now - self._first_at < REPEAT_WINDOW_S:
            return
        # A second request: exit now. Nothing is saved, so the newest committed checkpoint stays the one to resume.
        if self.on_stop_now is not None:
            try:
                self.on_stop_now()
            except Exception:  # last words must not turn an exit into a traceback
                pass
        sys.stderr.write(f"{signal_name(signum)} again: stopped at once without saving; the newest committed "
                         "checkpoint is the one a restart resumes from\n")
        sys.stderr.flush()
        os._exit(exit_status(signum))

    def agreed(self, step: int) -> bool:
        """After `step`: whether every rank stops here (collective every `every` steps; one step of delay)."""
        if self.stopping:
            return True
        if not self.distributed:
            self.stopping = self.requested
        elif step % self.every == 0:
            self._exchange()
        return self.stopping

    def poll(self) -> None:
        """Between two batches of a long phase: raise StopAgreed once every rank agreed to stop. Every rank must call
        it equally often in the phase (one asynchronous exchange per call, read at the next call)."""
        if not self.stopping:
            if self.distributed:
                self._exchange()
            else:
                self.stopping = self.requested
        if self.stopping:
            assert self.signum is not None
            raise StopAgreed(self.signum)

    def check_now(self) -> None:
        """`poll`, blocking: the flags of this moment, exchanged and read (for a boundary between set-up phases,
        where no batch overlaps the exchange)."""
        if self.distributed and not self.stopping:
            self._exchange()  # reads the exchange in flight, if any, and starts one with this rank's flag now
        self.poll()  # waits for it

    def poll_padded(self, calls: int) -> PaddedPoll:
        """A per-item `poll` for a phase whose ranks hold different numbers of items (pipeline stages' tensors):
        call the returned function after each of this rank's `calls` items, and `.finish()` it at the end; every
        rank then polls the largest count of any rank (one blocking all-reduce here)."""
        return PaddedPoll(self, calls)

    def _exchange(self) -> None:
        """Read the exchange in flight (started one call ago) and start the next with this rank's flag."""
        agreed = 0
        if self._work is not None:
            self._work.wait()
            self._work = None
            agreed = int(self._flag.item()) if self._flag is not None else 0
        if agreed:
            if self.signum is None:  # a signal that reaches this rank from now on repeats the one agreed on
                self._first_at = time.monotonic()
            self.signum = agreed  # the same signal on every rank, also on those that did not receive one
            self.stopping = True
            return
        # Each rank's signal number (0: none); the largest wins, so every rank exits with the same status.
        self._flag = torch.tensor([self.signum or 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)

    def saved(self) -> None:
        """The stop's checkpoint is committed: later signals are ignored. A rank of a launcher's job ignores them
        until it exits, also while the interpreter shuts down (which puts Python-level handlers back to the
        default, but keeps SIG_IGN): once one rank has exited, the agent signals those still tearing down."""
        self._saved = True
        if _under_agent() and threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)

    def close(self) -> None:
        """Wait for the exchange in flight; give the signals back, unless this process stopped on one: then it
        keeps ignoring them until it exits (a launcher may signal it again while it tears down)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._saved and _under_agent():
            return
        for sig, handler in self._handlers.items():
            if handler is not None:  # None: installed outside Python, nothing to restore
                signal.signal(sig, handler)
        self._handlers = {}


class PaddedPoll:
    """`StopRequest.poll_padded`'s function: polls after each item, then up to the largest count of any rank."""

    def __init__(self, stop: StopRequest, calls: int) -> None:
        self.stop, self.done = stop, 0
        self.total = calls
        if stop.distributed:
            count = torch.tensor([calls], dtype=torch.int64)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=stop._group)
            self.total = int(count.item())

    def __call__(self) -> None:
        self.done += 1
        self.stop.poll()

    def finish(self) -> None:
        while self.done < self.total:
            self()
