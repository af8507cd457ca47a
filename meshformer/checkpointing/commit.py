"""Turning a fully written step-N.partial/ folder into a committed step-N/ checkpoint (rank 0 only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshformer.checkpointing import directory as layout
from meshformer.checkpointing.manifest import fsync_dir, write_manifest


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / (layout.step_dir_name(step) + layout.PARTIAL_SUFFIX)


def commit(partial: Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Manifest, then rename to step-N/, then the `latest` pointer: a crash at any point leaves either the
    previous checkpoint as the newest valid one, or the new one complete."""
    root = partial.parent
    write_manifest(partial, step, extra)
    final = root / layout.step_dir_name(step)
    if final.exists():  # an older save of this step (e.g. one found corrupt): replace it
        layout.remove_tree(final)
    os.replace(partial, final)
    fsync_dir(root)
    layout.write_latest(root, final.name)
    return final
