"""What a failed save or an unusable checkpoint directory tells the user: what failed, what is intact, what to do."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from meshformer.checkpointing.checkpoint_errors import CheckpointError

# DCP reports a failed write as CheckpointException, which derives from BaseException: name it to catch it.
SAVE_FAILURES = (Exception, CheckpointException)
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def root_causes(err: BaseException) -> list[BaseException]:
    """The error and what it wraps: DCP's per-rank failures, explicit causes and the exceptions being handled."""
    out: list[BaseException] = []
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        out.append(current)
        if isinstance(current, CheckpointException):
            todo.extend(exc for exc, _ in current.failures.values())
        todo.extend([current.__cause__, current.__context__])
    return out


def os_errno(err: BaseException) -> int | None:
    return err.errno if isinstance(err, OSError) else None


def is_disk_full(err: BaseException) -> bool:
    return any(os_errno(e) in _DISK_FULL for e in root_causes(err))


def save_failed_error(err: BaseException, step: int, root: Path, newest: str | None) -> CheckpointError:
    """`newest`: the newest committed folder before step N (a full disk's step-N.partial/ is already removed)."""
    if isinstance(err, CheckpointError) and not is_disk_full(err):
        return err
    intact = (f"{newest} (the newest checkpoint) is intact" if newest
              else "no earlier checkpoint exists in that folder")
    if is_disk_full(err):
        return CheckpointError(
            f"no space left on device while saving checkpoint step {step} to {root}; {intact} and the unfinished "
            f"{Path(root).name}/step-{step:08d}.partial was removed — free space on that disk, point checkpoint.dir "
            "at a larger one, or lower checkpoint.keep_last")
    causes = [e for e in root_causes(err) if not isinstance(e, CheckpointException)] or [err]
    cause = causes[-1]
    return CheckpointError(
        f"saving checkpoint step {step} to {root} failed ({type(cause).__name__}: {cause}); {intact} (resume never "
        "reads the unfinished .partial folder) — check that checkpoint.dir is writable and healthy")


def all_corrupt_error(root: Path, corrupt: Sequence[tuple[Path, BaseException]]) -> CheckpointError:
    """Every committed checkpoint failed verification: stop instead of silently starting at step 0."""
    why = "; ".join(f"{path.name}: {err}" for path, err in corrupt[:4])
    more = f" (+{len(corrupt) - 4} more)" if len(corrupt) > 4 else ""
    return CheckpointError(
        f"every checkpoint in {root} failed verification ({why}{more}); nothing was moved or deleted — restore "
        f"them from a backup, or move them out of {root} to start from step 0")


def final_weights_failed_error(err: BaseException, final: Path) -> BaseException | None:
    """A failed write of the run's final weights as one line (None: not an I/O failure, a bug to show in full).
    The weights were written beside `final` (`final.partial`), so an earlier final/ is unchanged."""
    if is_disk_full(err):
        return CheckpointError(
            f"no space left on device while writing the final weights to {final}; the checkpoints and any earlier "
            f"{final.name}/ are unchanged — free space on that disk (or point logging.run_dir at a larger one) and "
            "run the same command again: it resumes from the newest checkpoint and writes them")
    code = next((os_errno(e) for e in root_causes(err) if os_errno(e) is not None), None)
    return None if code is None else OSError(code, os.strerror(code), str(final))
