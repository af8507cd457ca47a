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
import zlib
from collections.abc import Generator, Iterator
from contextlib import closing
from pathlib import Path
from typing import Literal

from meshformer.errors import MeshformerError

BUNDLED_CORPORA = {"bundled:kjv": Path(__file__).resolve().parent / "corpus" / "kjv-chapters.jsonl.gz"}
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".jsonl", ".json"}
DocSplit = Literal["file", "paragraph", "line"]
_HEAD_BYTES = 1 << 16  # head of each file checked before any work starts
_CHUNK_BYTES = 1 << 22  # pieces in which files are read and checked
BOM = "\ufeff"


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
    all-empty corpus, JSONL whose first record lacks the text field. Reads only the head of each file (the rest
    is checked as it is read: `read_text`)."""
    has_text = False
    for path in files:
        with closing(read_text(path, _HEAD_BYTES)) as pieces:
            head = next(pieces, "")
            lines = head.splitlines()
            complete = len(lines) > 1 or next(pieces, None) is None  # the first record was read whole
        has_text = has_text or bool(head.strip())
        if text_field and _is_jsonl(path) and complete:
            lineno, first = next(((i, line) for i, line in enumerate(lines, 1) if line.strip()), (0, ""))
            if first:
                _field(path, lineno, first, text_field)
    if not has_text:
        raise CorpusError(f"the corpus {[str(f) for f in files][:3]} holds no text (empty files)",
                          "point data.corpus (or the inputs of `data prepare`) at files that hold text")


def read_text(path: Path, chunk_bytes: int = _CHUNK_BYTES) -> Generator[str, None, None]:
    """The file's text in pieces of about `chunk_bytes` bytes (decompressed if .gz), newlines as "\n", without a
    leading UTF-8 byte-order mark. Every byte is checked: a byte that is not UTF-8, or a NUL, stops the read
    with the file and its byte offset (in the decompressed text)."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes of the file decoded before `raw`
    first = True
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as fh:
            while raw := fh.read(chunk_bytes):
                yield from _decode(path, decoder, raw, offset, first)
                offset += len(raw)
                first = False
            yield from _decode(path, decoder, b"", offset, first, final=True)
    except (OSError, EOFError, zlib.error) as err:
        raise CorpusError(f"{path}: cannot be read ({err})", "repair or remove the file") from None


def _decode(path: Path, decoder: io.IncrementalNewlineDecoder, raw: bytes, offset: int, first: bool,
            final: bool = False) -> Iterator[str]:
    pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous piece
    nul = raw.find(b"\0")  # valid UTF-8, but no text holds it
    try:
        text = decoder.decode(raw, final)
    except UnicodeDecodeError as err:
        at = offset - pending + err.start
        if nul < 0 or offset + nul > at:  # report whichever comes first
            raise _not_text(path, at, f"byte {err.object[err.start]:#04x}") from None
    if nul >= 0:
        raise _not_text(path, offset + nul, "a NUL byte")
    if first and text.startswith(BOM):  # a UTF-8 byte-order mark says how the file is encoded; it is not text
        text = text[1:]
    if text:
        yield text


def _not_text(path: Path, offset: int, what: str) -> CorpusError:
    return CorpusError(f"{path} is not UTF-8 text ({what} at byte offset {offset})",
                       "remove it from the corpus or convert it to UTF-8 text (binary data, Latin-1 or UTF-16 "
                       "files tokenize as garbage)")


def _lines(path: Path) -> Iterator[str]:
    """The file's lines (each with its "\n", except perhaps the last), read piece by piece."""
    rest = ""
    for text in read_text(path):
        lines = (rest + text).split("\n")
        rest = lines.pop()
        yield from (line + "\n" for line in lines)
    if rest:
        yield rest


def _is_text(path: Path) -> bool:
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    return Path(name).suffix in TEXT_SUFFIXES


def _is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    return name.endswith((".jsonl", ".json"))


def iter_documents(files: list[Path], text_field: str = "text", doc_split: DocSplit = "file") -> Iterator[str]:
    for path in files:
        if _is_jsonl(path):
            for lineno, line in enumerate(_lines(path), 1):
                if line.strip():
                    text = _field(path, lineno, line, text_field)
                    if text.strip():
                        yield text
        elif doc_split == "file":
            text = "".join(read_text(path))
            if text.strip():
                yield text
        elif doc_split == "line":
            yield from (line.rstrip("\n") for line in _lines(path) if line.strip())
        else:
            yield from (p.strip() for p in "".join(read_text(path)).split("\n\n") if p.strip())


def iter_pairs(files: list[Path], src_field: str = "src", tgt_field: str = "tgt") -> Iterator[tuple[str, str]]:
    for path in files:
        if not _is_jsonl(path):
            raise CorpusError(f"{path}: source/target pairs must come from JSONL with {src_field!r} and "
                              f"{tgt_field!r} fields")
        for lineno, line in enumerate(_lines(path), 1):
            if line.strip():
                yield _field(path, lineno, line, src_field), _field(path, lineno, line, tgt_field)


def _field(path: Path, lineno: int, line: str, name: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        if line.strip() in ("[", "{"):  # the first line of a pretty-printed JSON document or array
            raise CorpusError(f"{path}:{lineno}: not JSONL ({line.strip()!r} alone on a line: a pretty-printed JSON "
                              "file?)", "JSONL holds one JSON object per line: rewrite the file that way (jq -c "
                              "'.[]' for an array of objects, jq -c . for a stream of objects)") from None
        raise CorpusError(f"{path}:{lineno}: not valid JSON ({err})", "fix or remove that line (JSONL holds one "
                          "complete JSON object per line)") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{path}:{lineno}: a JSON {type(record).__name__}, not an object",
                          f"JSONL holds one JSON object per line, e.g. {{\"{name}\": \"...\"}}")
    if not isinstance(record.get(name), str):
        raise CorpusError(f"{path}:{lineno}: no string field {name!r} (has {sorted(record)}); set data.text_field "
                          "or --text-field")
    return record[name]
