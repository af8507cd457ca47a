"""The layout of a checkpoint directory: step folders, in-progress folders, the latest pointer, retention.

    <dir>/step-00000200/          committed (renamed from .partial after the manifest was written)
    <dir>/step-00000300.partial/  being written, or left behind by a crash: always ignored
    <dir>/step-00000100.deleting/ being removed by retention (renamed first, so no committed name is ever
                                  left half-deleted); leftovers of a crash are removed at the next start
    <dir>/latest                  name of the newest committed folder, updated last (for people and tools)
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.manifest import fsync_dir

PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
LATEST = "latest"
TRAINER_STATE = "trainer_state.json"  # rank 0: step, counters, scheduler, optimizer groups, data, config
RUN_CONFIG = "config.toml"  # the resolved config, for people
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer (checkpoints and weights folders carry it)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    """Per-rank JSON (RNG states)."""
    return f"rank-{rank:05d}.json"


def committed_steps(root: Path) -> list[int]:
    """Steps of committed folders, ascending (partial folders and stray files are not listed)."""
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            steps.append(int(match.group(1)))
    return sorted(steps)


def partial_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX))


def read_latest(root: Path) -> str | None:
    path = root / LATEST
    return path.read_text().strip() if path.is_file() else None


def check_latest(root: Path) -> None:
    """A `latest` that the next save could not replace (a folder, a dangling link) or that names no step folder
    (garbage): refused before step 1, not at the first save. One naming a step since moved aside is fine."""
    path = root / LATEST
    if not (path.exists() or path.is_symlink()):
        return
    fix = f"remove it (meshformer writes {LATEST} at each save), or set checkpoint.dir to another folder"
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f"{path} is a link to {os.readlink(path)}, which does not exist", fix)
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file (a folder or a special file)", fix)
    name = path.read_text(errors="replace").strip()  # an unreadable file: an OSError, one line as well
    if not _STEP_DIR.match(name):
        raise CheckpointError(f"{path} should name a step folder (e.g. step-00000100) but holds {name[:40]!r}", fix)


def write_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    tmp.replace(root / LATEST)
    fsync_dir(root)


def steps_to_delete(steps: list[int], keep_last: int, keep_every: int, protect: set[int] | frozenset = frozenset()
                    ) -> list[int]:
    """Retention: keep the newest `keep_last` (0 keeps all), every `keep_every`-th step, and `protect`."""
    if keep_last <= 0:
        return []
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) | set(protect)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


def deleting_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(DELETING_SUFFIX))


def remove_tree(path: Path) -> None:
    """Delete a folder so that a crash part-way never leaves a half-deleted folder under its old name: rename it
    to <name>.deleting (atomic) first, then remove the files; `remove_leftovers` finishes the job after a crash."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path if path.name.endswith(DELETING_SUFFIX) else path.with_name(path.name + DELETING_SUFFIX)
    if doomed != path:
        if doomed.exists():  # an earlier interrupted delete of the same name
            shutil.rmtree(doomed, ignore_errors=True)
        path.replace(doomed)
        fsync_dir(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(root: Path) -> list[Path]:
    """Remove what a crash left behind: unfinished saves (*.partial) and unfinished deletes (*.deleting)."""
    leftovers = partial_dirs(root) + deleting_dirs(root)
    for path in leftovers:
        remove_tree(path)
    return leftovers
