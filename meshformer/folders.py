"""Folders meshformer writes, and the rule that keeps it from destroying anyone else's.

A command that writes a folder (prepared shards, converted weights, a run's final weights, and their scratch
folders) marks it with `.meshformer` and replaces an existing folder only when that folder is one of ours (it
holds the marker, or the files an older meshformer left there) or the user passed `--overwrite`; the folder
it reads from is never an output, with or without `--overwrite`. Scratch folders beside an output
(`<out>.work`, `<out>.partial`) are removed only if they hold our marker: a folder of that name that someone
else made is reported, not deleted.

Folders are also closed worlds: a manifest or weights index names files *inside* its folder (`inside`), never
an absolute path, `..`, a URL or a `pipe:` command; remote or command sources come only from the user's config.
A link that takes a file of an input folder outside it is refused too (`check_links`) unless the user's option
says to follow it, except the Hugging Face hub cache's layout (snapshot files linking into the cache's blobs/).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from meshformer.errors import MeshformerError

MARKER = ".meshformer"


class OutputFolderError(MeshformerError, FileExistsError):
    """An output folder we may not write: someone else's, the input itself, or ours without --overwrite."""


class UnsafePathError(MeshformerError, ValueError):
    """A manifest or index names a file outside its own folder (or a URL / shell command)."""


def mark(folder: Path, contents: str) -> None:
    """Declare `folder` ours: `contents` says what it holds (e.g. "prepared shards", "weights"; markers of earlier
    releases say it as "kind": only the marker's presence is read)."""
    (Path(folder) / MARKER).write_text(json.dumps({"contents": contents, "pid": os.getpid()}) + "\n")


def is_ours(folder: Path, legacy: Iterable[str] = ()) -> bool:
    """True if `folder` holds our marker, or every file in `legacy` (what an older meshformer left there)."""
    folder = Path(folder)
    legacy = list(legacy)
    return (folder / MARKER).is_file() or (bool(legacy) and all((folder / name).is_file() for name in legacy))


def _overlaps(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a in b.parents or b in a.parents


def check_output(out: Path, *, what: str, overwrite: bool, inputs: Iterable[Path] = (),
                 legacy: Iterable[str] = (), option: str = "--overwrite") -> None:
    """Refuse, before any work, an output folder we may not write. Allowed: a missing or empty folder; one of ours
    (marker or `legacy` files) when `overwrite`; someone else's only when `overwrite` too. Never a folder that is,
    holds, or lies inside one of `inputs`."""
    out = Path(out)
    for source in inputs:
        if _overlaps(out, Path(source)):
            raise OutputFolderError(f"the output folder {out} overlaps the input {source}",
                                    "write the output to a folder of its own, outside the input")
    if out.is_symlink():  # the link is the user's: replacing the folder would rename or delete it
        raise OutputFolderError(f"the output {out} is a symbolic link (to {os.readlink(out)})",
                                f"pass the folder it points to ({out.resolve()}) or another folder path; meshformer "
                                "never renames or removes a link")
    if out.is_file():
        raise OutputFolderError(f"the output {out} is a file", "choose a folder path for the output")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if overwrite:
        return
    if is_ours(out, legacy):
        raise OutputFolderError(f"{out} already holds {what}", f"pass {option} to replace it, or choose another "
                                "output folder")
    raise OutputFolderError(f"{out} exists and holds files meshformer did not write", "choose another output "
                            f"folder (or pass {option} if you mean to delete everything in it)")


def scratch(path: Path, contents: str, *, fresh: bool = True) -> Path:
    """A scratch folder of ours at `path` (e.g. `<out>.work`): made and marked if missing; if it exists it must
    hold our marker (someone else's folder of that name is reported, never deleted). `fresh` empties it first."""
    path = Path(path)
    if path.exists():
        _check_scratch(path)
        if fresh:
            remove(path)
    if not path.exists():
        _make_marked(path, contents)
    return path


def _check_scratch(path: Path) -> None:
    if not path.is_dir() or not (path / MARKER).is_file():
        raise OutputFolderError(f"{path} exists and was not made by meshformer", "move it away or choose "
                                "another output folder (meshformer keeps its scratch files there)")


def _make_marked(path: Path, contents: str) -> None:
    """Create `path` already holding our marker: parts of one job (machines sharing `<out>.work`) may create it
    at the same moment, and none of them may see it unmarked."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f"{path.name}.", suffix=".new", dir=path.parent))
    staged.chmod(0o777 & ~umask())  # mkdtemp makes it private (700); outputs are for the user's team to read
    mark(staged, contents)
    try:
        staged.rename(path)
    except OSError:  # another process made it first (a non-empty folder cannot be renamed onto)
        shutil.rmtree(staged)
        _check_scratch(path)


def umask() -> int:
    """The process's umask, read without changing it where Linux says it (setting it, even briefly, would race
    with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove(folder: Path) -> None:
    """Delete a folder of ours; one without our marker is refused, so a bug can never delete a user's folder."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not (folder / MARKER).is_file():
        raise OutputFolderError(f"refusing to delete {folder}: it was not made by meshformer",
                                "move it away yourself if it should go")
    shutil.rmtree(folder)


def replace(staged: Path, out: Path) -> None:
    """Move the finished folder `staged` to `out`, replacing what is there (already checked by `check_output`):
    readers see the old folder or the new one, never a half-written one."""
    staged, out = Path(staged), Path(out)
    if out.exists():
        old = out.with_name(out.name + ".replaced")
        remove(old)  # a leftover of ours from a crash mid-replace; anything else is refused
        out.rename(old)
        staged.rename(out)
        shutil.rmtree(old)
    else:
        staged.rename(out)


def inside(folder: Path, name: object, *, what: str, fix: str, follow_links: bool = False) -> Path:
    """The path of `name` in `folder`, if `name` is a plain relative file name that stays inside it; otherwise
    one line naming `what` lists it (an absolute path, `..`, a URL, a `pipe:` command, a non-string). A link
    leaving the folder is refused as `check_links` refuses it, unless `follow_links`."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafePathError(f"{what} names {name!r}, which is not a file name", fix)
    if ":" in name.split("/", 1)[0] or name.startswith(("/", "\\", "~")) or os.path.isabs(name):
        raise UnsafePathError(f"{what} names {name!r}, which is not a file inside its folder (absolute paths, "
                              "URLs and pipe: commands are refused)", fix)
    parts = Path(name).parts
    if ".." in parts:
        raise UnsafePathError(f"{what} names {name!r}, which leaves its folder", fix)
    if not follow_links and (target := _leaves(Path(folder), Path(folder) / name)) is not None:
        raise UnsafePathError(f"{what} names {name!r}, which resolves outside {folder} (a link to {target})", fix)
    return Path(folder) / name


def _roots(folder: Path) -> list[Path]:
    """Where the files of `folder` may lie once links are resolved: in the folder itself, and for a snapshot of
    the Hugging Face hub cache (`models--org--name/snapshots/<rev>/`, whose files link to `../../blobs/<hash>`)
    in that cache's `blobs/`."""
    root = Path(folder).resolve()
    blobs = root.parent.parent / "blobs"
    return [root, blobs] if root.parent.name == "snapshots" and blobs.is_dir() else [root]


def _leaves(folder: Path, path: Path, roots: list[Path] | None = None) -> Path | None:
    """Where `path` really is, if a link takes it out of `folder` (None: it stays inside)."""
    target = Path(path).resolve()
    return None if any(root in target.parents for root in roots or _roots(folder)) else target


def check_links(folder: Path, paths: Iterable[Path], *, what: str, fix: str) -> None:
    """Folders are closed worlds for links too: refuse, in one line, any of `paths` (files of `folder`) that a
    link takes outside `folder` (a file linked to /etc/passwd is not part of a corpus or a model). The Hugging
    Face hub cache's own layout (snapshot files linking into its blobs/) stays inside."""
    roots = _roots(folder)
    leaving = [(p, target) for p in paths if (target := _leaves(folder, p, roots)) is not None]
    if leaving:
        (path, target), more = leaving[0], len(leaving) - 1
        raise UnsafePathError(f"{what}: {path} links to {target}, outside {folder}"
                              f"{f' (and {more} more link(s) leave it)' if more else ''}", fix)
