"""The manifest that makes a checkpoint folder trustworthy: every file with its size and sha256.

It is written last, after every rank finished writing, so its presence plus matching files means the
checkpoint is complete; a truncated or bit-flipped shard shows up as a size or hash mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Literal

from meshformer.checkpointing.checkpoint_errors import CheckpointError, CorruptCheckpointError

MANIFEST = "manifest.json"
FORMAT = "meshformer-checkpoint"
VERSION = 1
_CHUNK = 8 << 20

Verify = Literal["sha256", "size"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # hashlib releases the GIL on large buffers: async commits overlap training
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temporary name, fsync, rename: readers see the old or the new file, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def list_files(folder: Path) -> list[str]:
    """Every regular file under `folder` (relative POSIX paths), the manifest itself excluded."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = Path(root, name).relative_to(folder).as_posix()
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(folder: Path, step: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    files = {rel: {"size": (folder / rel).stat().st_size, "sha256": sha256_file(folder / rel)}
             for rel in list_files(folder)}
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(), "files": files,
                **(extra or {})}
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CorruptCheckpointError(f"{folder} has no {MANIFEST}: the save did not finish (incomplete checkpoint)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({err}): the manifest is damaged") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCheckpointError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version", 0) > VERSION:  # not corrupt: must not be moved aside as if it were
        raise CheckpointError(f"{path} was written by a newer meshformer (format version {manifest['version']}; "
                              f"this one reads up to {VERSION}); upgrade meshformer to load it")
    return manifest


def verify_manifest(folder: Path, mode: Verify = "sha256") -> dict[str, Any]:
    """Check every listed file's size (and hash); raise CorruptCheckpointError naming the first bad file."""
    manifest = read_manifest(folder)
    for rel, entry in manifest["files"].items():
        path = folder / rel
        if not path.is_file():
            raise CorruptCheckpointError(f"{path} is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CorruptCheckpointError(f"{path} has {size} bytes, the manifest says {entry['size']} (truncated?)")
        if mode == "sha256" and sha256_file(path) != entry["sha256"]:
            raise CorruptCheckpointError(f"{path} does not match its sha256 in the manifest (corrupted)")
    return manifest
