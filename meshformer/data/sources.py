"""Reading raw corpora: text files, directories, `.gz`, JSONL (one field, or src/tgt pairs).

A *document* is one JSONL record's field, or one whole text file (`doc_split="file"`), or one
blank-line-separated paragraph (`"paragraph"`), or one line (`"line"`). Directories are walked in
sorted order so the document sequence, and hence every prepared shard, is reproducible.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from meshformer.errors import MeshformerError

BUNDLED_CORPORA = {"bundled:kjv": Path(__file__).resolve().parent / "corpus" / "kjv-chapters.jsonl.gz"}
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".jsonl", ".json"}
DocSplit = Literal["file", "paragraph", "line"]
_SNIFF_BYTES = 1 << 16  # head of each file checked for binary content


class CorpusError(MeshformerError, ValueError):
    """An input corpus that cannot be read as documents."""


def resolve_inputs(inputs: str | Path | list[str | Path]) -> list[Path]:
    """Expand bundled names and directories into a sorted, de-duplicated list of files."""
    items = inputs if isinstance(inputs, list) else [inputs]
    files: list[Path] = []
    for item in items:
        if str(item) in BUNDLED_CORPORA:
            files.append(BUNDLED_CORPORA[str(item)])
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and _is_text(p))
            if not found:
                raise CorpusError(f"directory {path} holds no text files ({sorted(TEXT_SUFFIXES)}, optionally .gz)",
                                  "add text files or point at another folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CorpusError(f"corpus input {str(item)!r} does not exist; pass a file, a directory, or "
                              f"one of {sorted(BUNDLED_CORPORA)}")
    return list(dict.fromkeys(files))


def check_corpus(files: list[Path], text_field: str | None = "text") -> None:
    """Refuse, naming the file, what would tokenize as garbage or nothing: binary (or UTF-16) files, an
    all-empty corpus, JSONL whose first record lacks the text field. Reads only the head of each file."""
    has_text = False
    for path in files:
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as fh:
                head = fh.read(_SNIFF_BYTES)
        except (OSError, EOFError) as err:
            raise CorpusError(f"{path}: cannot be read ({err})", "repair or remove the file") from None
        text = codecs.getincrementaldecoder("utf-8")(errors="replace").decode(head)
        if b"\0" in head or text.count("\ufffd") > max(8, len(text) // 100):
            raise CorpusError(f"{path} is not UTF-8 text (binary data or NUL bytes in its first {len(head)} bytes)",
                              "remove it from the corpus or convert it to UTF-8 text")
        has_text = has_text or bool(text.strip())
        lines = text.splitlines()
        complete = len(head) < _SNIFF_BYTES or len(lines) > 1  # the first record was read whole
        if text_field and _is_jsonl(path) and complete:
            lineno, first = next(((i, line) for i, line in enumerate(lines, 1) if line.strip()), (0, ""))
            if first:
                _field(path, lineno, first, text_field)
    if not has_text:
        raise CorpusError(f"the corpus {[str(f) for f in files][:3]} holds no text (empty files)",
                          "point data.corpus (or the inputs of `data prepare`) at files that hold text")


def _is_text(path: Path) -> bool:
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    return Path(name).suffix in TEXT_SUFFIXES


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    return name.endswith((".jsonl", ".json"))


def iter_documents(files: list[Path], text_field: str = "text", doc_split: DocSplit = "file") -> Iterator[str]:
    for path in files:
        with _open_text(path) as fh:
            if _is_jsonl(path):
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        text = _field(path, lineno, line, text_field)
                        if text.strip():
                            yield text
            elif doc_split == "file":
                text = fh.read()
                if text.strip():
                    yield text
            elif doc_split == "line":
                yield from (line.rstrip("\n") for line in fh if line.strip())
            else:
                yield from (p.strip() for p in fh.read().split("\n\n") if p.strip())


def iter_pairs(files: list[Path], src_field: str = "src", tgt_field: str = "tgt") -> Iterator[tuple[str, str]]:
    for path in files:
        if not _is_jsonl(path):
            raise CorpusError(f"{path}: source/target pairs must come from JSONL with {src_field!r} and "
                              f"{tgt_field!r} fields")
        with _open_text(path) as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield _field(path, lineno, line, src_field), _field(path, lineno, line, tgt_field)


def _field(path: Path, lineno: int, line: str, name: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}:{lineno}: not valid JSON ({err})", "fix or remove that line") from None
    if not isinstance(record, dict) or not isinstance(record.get(name), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(f"{path}:{lineno}: no string field {name!r} (has {keys}); set data.text_field "
                          "or --text-field")
    return record[name]
