"""Turning a fully written step-N.partial/ folder into a committed step-N/ checkpoint (rank 0 only)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshformer.checkpointing import directory
from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.manifest import fsync_dir, write_manifest


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / (directory.step_dir_name(step) + directory.PARTIAL_SUFFIX)


def commit(partial: Path, step: int, extra: dict[str, Any] | None = None) -> Path:
    """Manifest, then rename to step-N/, then the `latest` pointer: a crash at any point leaves either the
    previous checkpoint as the newest valid one, or the new one complete."""
    root = partial.parent
    write_manifest(partial, step, extra)
    final = root / directory.step_dir_name(step)
    if final.exists():  # committed by someone else (another run on this folder): never ours to replace
        raise CheckpointError(f"{final} already holds a committed checkpoint of step {step} that this run did not "
                              f"write; it was left as it is, and this save stays unfinished in {partial.name}",
                              "make sure only one run writes to this folder (logging.run_dir / checkpoint.dir), "
                              f"or move {final.name} away")
    os.replace(partial, final)
    fsync_dir(root)
    directory.write_latest(root, final.name)
    return final
