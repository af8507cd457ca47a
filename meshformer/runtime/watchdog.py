"""Hang diagnostics: what every rank was doing when the job stopped making progress, and who was slowest.

The trainer marks each phase of a step (`watchdog.phase("data")`, ...). A daemon thread per rank watches
the marks: a phase that lasts longer than half of `parallel.timeout_s` makes the rank write
`<run_dir>/diagnostics/hang-rank<R>.json` (step, phase, the last collective it issued and how many, its
Python stack), so the report exists even when the rank is stuck for good. The report is removed when the
rank moves on. When a collective times out, `guard()` writes the failing rank's report, reads everyone's,
and raises `CollectiveTimeoutError` naming the slowest rank: the one with no report (dead, or stuck in
native code holding the GIL), else the one furthest behind by (step, phase, collectives issued).
`meshformer diagnose RUN_DIR` prints the same verdict after the fact. Reports of other nodes are visible
when the run folder is on a shared filesystem (as checkpoints need anyway).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from meshformer.errors import MeshformerError

# Order of the phases within one step: a rank in an earlier phase of the same step is behind.
# Fault-tolerant replica groups add "quorum" (the step's quorum, a heal, local_sgd / diloco's synchronisation) and
# "cross_group" (the gradients' average over the groups).
PHASES = ("startup", "quorum", "data", "forward_backward", "cross_group", "grad_norm", "optimizer", "logging", "eval",
          "sample", "checkpoint", "finish")
# Phases in which a rank waits for the other replica groups, not for the ranks of its own.
CROSS_GROUP_PHASES = ("quorum", "cross_group")
REPORT_GLOB = "hang-rank*.json"
# What `explain` reads from a report, and its JSON type.
REPORT_FIELDS: dict[str, type | tuple[type, ...]] = {
    "rank": int, "world_size": int, "host": str, "pid": int, "step": int, "phase": str,
    "seconds_in_phase": (int, float), "collectives_issued": int, "reason": str}


class HangReportError(MeshformerError, ValueError):
    """A hang report that is not one this watchdog wrote (edited, truncated, another tool's file)."""


def _run_id() -> str:
    """Identifies one (re)start of the job: reports of an earlier attempt are never mixed in."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def collectives_issued() -> tuple[int, dict[str, Any] | None]:
    """(collectives this rank issued, summed over process groups; the newest one) from the flight recorder."""
    try:
        from meshformer.runtime.distributed import last_collectives

        entries = last_collectives(limit=2000)
    except Exception:  # recorder disabled or torch without it: step and phase still tell a lot
        return 0, None
    newest_seq: dict[str, int] = {}
    for entry in entries:
        group = str(entry.get("process_group", ["?"])[-1])
        newest_seq[group] = max(newest_seq.get(group, 0), int(entry.get("collective_seq_id") or 0))
    last = entries[-1] if entries else None
    summary = None
    if last is not None:
        summary = {"name": last.get("profiling_name"), "sequence": last.get("collective_seq_id"),
                   "process_group": (last.get("process_group") or ["?"])[-1], "input_sizes": last.get("input_sizes"),
                   "state": last.get("state")}
    return sum(newest_seq.values()), summary


class HangWatchdog:
    def __init__(self, run_dir: Path, *, rank: int, world_size: int, timeout_s: float, enabled: bool = True,
                 replica_group: int | None = None) -> None:
        self.dir = Path(run_dir) / "diagnostics"
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.replica_group = replica_group  # fault_tolerance: this rank's replica group (its reports name it)
        self.report_after_s = timeout_s / 2
        self.step, self.phase_name, self.since = 0, "startup", time.monotonic()
        self.enabled = enabled
        self._reported = False  # a stall report of this rank is on disk
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._main_thread_id = threading.main_thread().ident

    @property
    def report_path(self) -> Path:
        return self.dir / f"hang-rank{self.rank}.json"

    def start(self) -> HangWatchdog:
        if self.enabled and self._thread is None:
            self.report_path.unlink(missing_ok=True)  # left by an earlier attempt of this job
            self._thread = threading.Thread(target=self._watch, name="meshformer-hang-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)  # a report it is writing must not overwrite the final one

    def phase(self, name: str, step: int | None = None) -> None:
        """Mark the start of a phase (cheap: two assignments and a clock read)."""
        if step is not None:
            self.step = step
        self.phase_name, self.since = name, time.monotonic()

    # ------------------------------------------------------------------ reports

    def state(self, reason: str, error: str | None = None) -> dict[str, Any]:
        issued, collective = collectives_issued()
        frame = sys._current_frames().get(self._main_thread_id or 0)
        return {
            "rank": self.rank, "world_size": self.world_size, "replica_group": self.replica_group,
            "host": socket.gethostname(), "pid": os.getpid(),
            "run": _run_id(), "step": self.step, "phase": self.phase_name,
            "seconds_in_phase": round(time.monotonic() - self.since, 1), "collectives_issued": issued,
            "last_collective": collective, "reason": reason, "error": error, "written_at": time.time(),
            "stack": traceback.format_stack(frame) if frame is not None else [],
        }

    def write_report(self, reason: str, error: str | None = None) -> dict[str, Any]:
        report = self.state(reason, error)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, self.report_path)  # readers never see half a report
        return report

    def _watch(self) -> None:
        poll_s = max(0.2, min(5.0, self.report_after_s / 4))
        while not self._stop.wait(poll_s):
            stalled = time.monotonic() - self.since >= self.report_after_s
            try:
                if stalled:  # rewritten at every poll while it lasts: the duration and stack stay current
                    self.write_report(f"no progress for more than {self.report_after_s:.0f}s "
                                      "(half of parallel.timeout_s)")
                    self._reported = True
                elif self._reported:
                    self.report_path.unlink(missing_ok=True)  # it moved on: the stall resolved itself
                    self._reported = False
            except OSError:
                pass  # a full or read-only disk must not kill training; the timeout message still comes

    # ------------------------------------------------------------------ collective timeouts

    @contextlib.contextmanager
    def guard(self, on_error: Callable[[], None] | None = None) -> Iterator[None]:
        """Turn a collective timeout into a CollectiveTimeoutError naming the slowest rank."""
        self.start()
        try:
            yield
        except Exception as err:
            if on_error is not None:
                with contextlib.suppress(Exception):
                    on_error()
            from meshformer.runtime.distributed import CollectiveTimeoutError, is_timeout

            if not self.enabled or not is_timeout(err) or isinstance(err, CollectiveTimeoutError):
                raise
            self.stop()
            self.write_report("collective timeout", error=str(err).splitlines()[0][:500])
            reports = wait_for_reports(self.dir, self.world_size, _run_id(), grace_s=min(10.0, self.report_after_s))
            message = explain(reports, self.world_size, self.dir, waiting_rank=self.rank)
            with contextlib.suppress(OSError):
                (self.dir / f"verdict-rank{self.rank}.txt").write_text(message + "\n")
            try:
                raise CollectiveTimeoutError(message) from err
            except CollectiveTimeoutError as error:
                _record_for_torchrun(error)  # inside `except`: torchrun's summary shows this traceback
                raise
        finally:
            self.stop()


def _record_for_torchrun(error: BaseException) -> None:
    """Put the message into torchrun's failure summary (its error file), not only into this rank's stderr."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(error)


def read_reports(folder: Path, run: str | None = None, *, strict: bool = False) -> dict[int, dict[str, Any]]:
    """Every rank's report in `folder` (of one job attempt when `run` is given), by rank. A malformed report is
    skipped (a timed-out job still explains what it can), or refused with `strict` (`meshformer diagnose`)."""
    reports: dict[int, dict[str, Any]] = {}
    for path in sorted(Path(folder).glob(REPORT_GLOB)):
        try:
            report = _checked_report(path)
        except HangReportError:
            if strict:
                raise
            continue
        if run is None or report.get("run") == run:
            reports[report["rank"]] = report
    return reports


def _checked_report(path: Path) -> dict[str, Any]:
    fix = "remove it (or restore the file the job wrote) and run diagnose again"
    try:
        report = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise HangReportError(f"hang report {path} cannot be read as JSON ({err})", fix) from None
    if not isinstance(report, dict):
        raise HangReportError(f"hang report {path} is not a JSON object", fix)
    for key, kind in REPORT_FIELDS.items():
        if not isinstance(report.get(key), kind) or isinstance(report.get(key), bool):
            raise HangReportError(f"hang report {path} has no valid {key!r} field", fix)
    if not 0 <= report["rank"] < report["world_size"]:
        raise HangReportError(f"hang report {path} names rank {report['rank']} of a world of {report['world_size']}",
                              fix)
    return report


def wait_for_reports(folder: Path, world_size: int, run: str, grace_s: float) -> dict[int, dict[str, Any]]:
    """Reports of all ranks, waiting up to grace_s for the ones not written yet."""
    deadline = time.monotonic() + grace_s
    while True:
        reports = read_reports(folder, run)
        if len(reports) >= world_size or time.monotonic() >= deadline:
            return reports
        time.sleep(0.25)


def progress_key(report: dict[str, Any]) -> tuple[int, int, int]:
    phase = report.get("phase", "")
    return (int(report.get("step", 0)), PHASES.index(phase) if phase in PHASES else len(PHASES),
            int(report.get("collectives_issued", 0)))


def slowest_rank(reports: dict[int, dict[str, Any]], world_size: int) -> tuple[int | None, str]:
    """(rank, why): a rank without a report first, else the one furthest behind."""
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        return missing[0], "wrote no report: it died, or is stuck in native code that holds the Python GIL"
    if not reports:
        return None, "no reports"
    rank = min(reports, key=lambda r: (progress_key(reports[r]), -reports[r].get("seconds_in_phase", 0)))
    report = reports[rank]
    return rank, (f"{_group(report)}step {report['step']}, phase {report['phase']!r} for "
                  f"{report['seconds_in_phase']:.0f}s, "
                  f"{report['collectives_issued']} collectives issued, host {report['host']} pid {report['pid']}")


def _group(report: dict[str, Any]) -> str:
    """"replica group R, " for a rank of a fault-tolerant replica group, else ""."""
    group = report.get("replica_group")  # absent from reports of runs without fault tolerance
    return f"replica group {group}, " if group is not None else ""


def describe(report: dict[str, Any]) -> str:
    collective = report.get("last_collective") or {}
    name = f"{collective.get('name')} #{collective.get('sequence')}" if collective else "no collective recorded"
    waits = " waiting for the other replica groups" if report.get("phase") in CROSS_GROUP_PHASES else ""
    return (f"{_group(report)}rank {report['rank']}: step {report['step']}, phase {report['phase']!r}{waits} "
            f"({report['seconds_in_phase']:.0f}s), last collective {name}, "
            f"{report['collectives_issued']} issued ({report['reason']})")


def explain(reports: dict[int, dict[str, Any]], world_size: int, folder: Path, waiting_rank: int | None = None) -> str:
    """The message a timed-out job exits with, and that `meshformer diagnose` prints."""
    rank, why = slowest_rank(reports, world_size)
    head = "collective timeout"
    if waiting_rank is not None and waiting_rank in reports:
        waiting = reports[waiting_rank]
        collective = waiting.get("last_collective") or {}
        head = (f"collective timeout on {_group(waiting)}rank {waiting_rank} at step {waiting['step']} "
                f"(phase {waiting['phase']!r}, waiting in {collective.get('name', 'a collective')} "
                f"#{collective.get('sequence', '?')})")
    lines = [f"{head}; slowest rank: {rank} ({why})."]
    lines += [f"  {describe(reports[r])}" for r in sorted(reports)]
    lines.append(f"Per-rank reports with Python stacks: {folder}/. Fix what rank {rank} was doing (see its stack), "
                 "or raise parallel.timeout_s if that work is legitimately slow.")
    return "\n".join(lines)
