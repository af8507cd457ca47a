"""Which files a corpus is: bundled names, files, Megatron prefixes and folders, walked in sorted order so the
document sequence, and hence every prepared shard, is reproducible.

Nothing in a folder is dropped in silence: a file is read when its name or its first bytes say it is a corpus
format, skipped with a reason when it cannot be corpus text (binary, empty, hidden, a flat `.bin` whose token
type only the user knows), and refused when it holds text that is not named as a corpus (`NEWS.gz`, `README`):
`--include GLOB` says which files of a folder to read, whatever their names. The report (logged by prepare)
lists what was read and what was skipped, with counts and the first few names.
"""

from __future__ import annotations

import fnmatch
import json
import os
import zlib
from collections import Counter
from contextlib import closing
from pathlib import Path

from meshformer.folders import check_links

from .corpus_base import (
    BUNDLED_CORPORA,
    TABLE_SUFFIXES,
    TEXT_SUFFIXES,
    CorpusError,
    binary_format,
    detect,
    head,
    named_as_text,
)
from .corpus_text import open_raw

LINKS_FIX = "copy the linked files into the folder, or name them as inputs of their own"

_PROBE_BYTES = 1 << 12  # decompressed bytes read to tell text from binary
_NAMES_SHOWN = 5
_HF_METADATA = {"dataset_dict.json"}  # a DatasetDict's index of its splits (each split folder is read)


def resolve_inputs(inputs: str | Path | list[str | Path], include: list[str] | None = None,
                   report: list[str] | None = None, follow_links: bool = False,
                   links_fix: str = LINKS_FIX) -> list[Path]:
    """Expand bundled names, directories and Megatron prefixes into a sorted, de-duplicated list of files.

    In a directory (`include` unset): text/JSONL files (optionally .gz/.zst), Parquet, Arrow, `.npy` and Megatron
    `.idx` (its `.bin` goes with it), by name or by first bytes; flat `.bin` token files only when named (a
    folder's .bin may be anything); a Hugging Face `save_to_disk` folder contributes its Arrow files in the order
    its state.json lists them. With `include` (glob patterns matched against the file name or its path in the
    folder), exactly the matching files are read. Files named directly are always read. A folder's file or
    subfolder that a link takes outside the folder is refused (`links_fix` says what to do) unless
    `follow_links`. `report` gets a line per folder saying what was read and skipped (logged by the caller once
    the inputs are checked, so that an error stays the only line)."""
    items = inputs if isinstance(inputs, list) else [inputs]
    files: list[Path] = []
    for item in items:
        if str(item) in BUNDLED_CORPORA:
            files.append(BUNDLED_CORPORA[str(item)])
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            files.extend(_walk(path, include or [], report if report is not None else [], follow_links,
                               links_fix))
        elif path.is_file():
            files.append(_data_file(path))
        elif path.with_name(path.name + ".idx").is_file():  # a Megatron prefix, as Megatron's --data-path names it
            files.append(path.with_name(path.name + ".idx"))
        else:
            raise CorpusError(f"corpus input {str(item)!r} does not exist; pass a file, a directory, a Megatron "
                              f"dataset prefix, or one of {sorted(BUNDLED_CORPORA)}")
    return list(dict.fromkeys(files))


def _data_file(path: Path) -> Path:
    """The file to read for `path`: a Megatron dataset's `.bin` is read through its `.idx`."""
    return path.with_suffix(".idx") if path.suffix == ".bin" and path.with_suffix(".idx").is_file() else path


def _walk(folder: Path, include: list[str], report: list[str], follow_links: bool, links_fix: str) -> list[Path]:
    """A folder's input files in sorted order (a `datasets` folder's Arrow files in its own order, at its place);
    says in `report` what was read and skipped; refuses text files that are not named as corpus files."""
    hf = {p.parent: p for p in folder.rglob("state.json") if (p.parent / "dataset_info.json").is_file()}
    found: list[tuple[Path, list[Path]]] = [(parent, _hf_files(parent, state)) for parent, state in hf.items()]
    skipped: dict[str, list[Path]] = {}
    unnamed_text: list[Path] = []
    entries, linked_dirs = _entries(folder, follow_links)
    if not follow_links:  # a linked folder is not walked: one that leaves the folder is not part of it
        check_links(folder, [p for p in linked_dirs if not _hidden(p.relative_to(folder))],
                    what=f"corpus folder {folder}", fix=links_fix)
    candidates: list[Path] = []
    for p in entries:
        if not p.is_file() or hf.keys() & set(p.parents):
            continue
        rel = p.relative_to(folder)
        verdict = _classify(p, rel, include)
        if verdict == "read":
            found.append((p, [_data_file(p)]))
        elif verdict == "text":
            unnamed_text.append(rel)
        elif verdict:
            skipped.setdefault(verdict, []).append(rel)
        if verdict in ("read", "text"):
            candidates.append(p)
    if not follow_links:  # before anything is read from them, and before a refusal whose fix would read them
        check_links(folder, candidates, what=f"corpus folder {folder}", fix=links_fix)
    files = list(dict.fromkeys(f for _, group in sorted(found) for f in group))
    if unnamed_text:
        raise CorpusError(f"{folder}: {len(unnamed_text)} file(s) hold text but are not named as a corpus format "
                          f"({', '.join(sorted(TEXT_SUFFIXES))}, optionally .gz/.zst): {_first(unnamed_text)}",
                          "read them with --include GLOB (e.g. --include '*' for every file of the folder, or "
                          "--include '*.txt' --include NEWS.gz), or move them out of the folder")
    if not files:
        raise CorpusError(f"directory {folder} holds no text files ({sorted(TEXT_SUFFIXES)}, optionally .gz or "
                          f".zst), Parquet, Arrow or token files (.idx, .npy){_skipped_note(skipped)}",
                          "add text files (or other corpus files), pass --include GLOB, or point at another folder")
    formats = Counter(detect(f) for f in files)
    report.append(f"{folder}: reading {len(files)} file(s) ({', '.join(f'{n} {k}' for k, n in formats.items())})"
                  f"{_skipped_note(skipped)}")
    return files


def _entries(folder: Path, follow_links: bool) -> tuple[list[Path], list[Path]]:
    """(every path under `folder`, sorted; the linked folders under it). Linked folders are walked only when
    `follow_links`, each real folder once (a link to a parent would otherwise loop)."""
    paths: list[Path] = []
    linked: list[Path] = []
    seen = {os.path.realpath(folder)}
    for top, dirs, names in os.walk(folder, followlinks=follow_links):
        for name in list(dirs):
            path = Path(top) / name
            if path.is_symlink():
                linked.append(path)
                real = os.path.realpath(path)
                if real in seen:
                    dirs.remove(name)
                seen.add(real)
        paths.extend(Path(top) / name for name in [*dirs, *names])
    return sorted(paths), linked


def _classify(path: Path, rel: Path, include: list[str]) -> str:
    """"read", "text" (text not named as a corpus: refused), "" (read through another file), or why it is
    skipped."""
    if _hidden(rel):
        return "hidden"
    if include:
        matched = any(fnmatch.fnmatch(path.name, g) or fnmatch.fnmatch(rel.as_posix(), g) for g in include)
        return "read" if matched else "not matched by --include"
    if path.name in _HF_METADATA:
        return "datasets metadata"
    if path.suffix == ".bin":
        if path.with_suffix(".idx").is_file():
            return ""  # the .bin of a Megatron dataset: read through its .idx
        return "flat token file (read only when named, with --token-dtype)"
    if path.suffix in TABLE_SUFFIXES or path.suffix in (".idx", ".npy") or named_as_text(path):
        return "read"
    if binary_format(head(path, 9), path.suffix):
        return "read"
    return _probe_text(path)


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _probe_text(path: Path) -> str:
    """"text" when the file's first bytes (decompressed if gzip or zstd) are UTF-8 text, else why it is skipped."""
    try:
        with closing(open_raw(path)) as fh:
            data = fh.read(_PROBE_BYTES)
    except (CorpusError, OSError, EOFError, zlib.error):
        return "unreadable or not text"
    if not data:
        return "empty"
    if b"\0" in data:
        return "not text"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(data) - 3:  # not only a character cut by the probe's end
            return "not text"
    return "text"


def _first(paths: list[Path]) -> str:
    names = ", ".join(str(p) for p in paths[:_NAMES_SHOWN])
    return names + (f" and {len(paths) - _NAMES_SHOWN} more" if len(paths) > _NAMES_SHOWN else "")


def _skipped_note(skipped: dict[str, list[Path]]) -> str:
    if not skipped:
        return "; skipped none"
    total = sum(map(len, skipped.values()))
    return f"; skipped {total}: " + "; ".join(f"{len(p)} {why} ({_first(p)})" for why, p in skipped.items())


def _hf_files(folder: Path, state: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk folder, in its own order (state.json's `_data_files`)."""
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise CorpusError(f"{state}: not a Hugging Face datasets state.json (no _data_files list)",
                          "save the dataset again with save_to_disk, or pass its .arrow files") from None
    from meshformer.folders import inside

    return [inside(folder, n, what=str(state), fix="save the dataset again with save_to_disk") for n in names]
