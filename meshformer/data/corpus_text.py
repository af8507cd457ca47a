"""Text corpora: plain text and JSONL, gzip or zstd compressed (recognised by their first bytes), read in pieces
with every byte checked (UTF-8, no NUL) and errors that name the file and the byte offset."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from .corpus_base import COMPRESSED_SUFFIXES, GZIP_MAGIC, ZSTD_MAGIC, CorpusError, head, need

CHUNK_BYTES = 1 << 22  # pieces in which files are read and checked
BOM = "\ufeff"


def open_raw(path: Path) -> Any:
    """The file's bytes, decompressed by what its first bytes say (gzip, zstd), whatever its name."""
    first = head(path, 4)
    if first.startswith(GZIP_MAGIC):
        return gzip.open(path, "rb")
    if first.startswith(ZSTD_MAGIC):
        return _ZstdReader(path)
    if path.suffix in COMPRESSED_SUFFIXES and first:
        raise CorpusError(f"{path}: cannot be read (named {path.suffix} but not {path.suffix[1:]} data: starts "
                          f"with {first!r})", "repair or remove the file (or rename it if it is plain text)")
    return open(path, "rb")


class _ZstdReader:
    """Streaming zstd decompression of every frame of a file; a truncated or corrupt stream raises CorpusError
    with the compressed byte offset (the zstandard package's stream reader ends a truncated file in silence)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.zstd = need("zstandard")
        self.fh = open(path, "rb")
        self.dec = self.zstd.ZstdDecompressor().decompressobj()
        self.offset = 0  # compressed bytes consumed
        self.buf = bytearray()
        self.in_frame = False

    def read(self, n: int) -> bytes:
        while len(self.buf) < n:
            raw = self.fh.read(1 << 20)
            if not raw:
                if self.in_frame:
                    raise self._error("the file ends inside a zstd frame (truncated?)")
                break
            self._feed(raw)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def _feed(self, data: bytes) -> None:
        while data:
            try:
                self.buf += self.dec.decompress(data)
            except self.zstd.ZstdError as err:
                raise self._error(f"corrupt zstd data ({err})") from None
            if self.dec.eof:  # a frame ended; another may follow (pzstd and zstd -T write several)
                rest = self.dec.unused_data
                self.offset += len(data) - len(rest)
                self.dec = self.zstd.ZstdDecompressor().decompressobj()
                self.in_frame, data = False, rest
            else:
                self.offset += len(data)
                self.in_frame, data = True, b""

    def _error(self, what: str) -> CorpusError:
        return CorpusError(f"{self.path}: cannot be read: {what} near compressed byte offset {self.offset}",
                           "repair or remove the file (re-download it, or recompress it with zstd)")

    def close(self) -> None:
        self.fh.close()

    def __enter__(self) -> _ZstdReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_text(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Generator[str, None, None]:
    """The file's text in pieces of about `chunk_bytes` bytes (decompressed if gzip or zstd), newlines as "\n",
    without a leading UTF-8 byte-order mark. Every byte is checked: a byte that is not UTF-8, or a NUL, stops the
    read with the file and its byte offset (in the decompressed text); a truncated or corrupt compressed file
    stops it with the offset reached."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes of the file decoded before `raw`
    first = True
    try:
        with open_raw(path) as fh:
            while raw := fh.read(chunk_bytes):
                yield from _decode(path, decoder, raw, offset, first)
                offset += len(raw)
                first = False
            yield from _decode(path, decoder, b"", offset, first, final=True)
    except (OSError, EOFError, zlib.error) as err:
        raise CorpusError(f"{path}: cannot be read ({err}) after {offset} bytes of text",
                          "repair or remove the file") from None


def _decode(path: Path, decoder: io.IncrementalNewlineDecoder, raw: bytes, offset: int, first: bool,
            final: bool = False) -> Iterator[str]:
    pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous piece
    nul = raw.find(b"\0")  # valid UTF-8, but no text holds it
    try:
        text = decoder.decode(raw, final)
    except UnicodeDecodeError as err:
        at = offset - pending + err.start
        if nul < 0 or offset + nul > at:  # report whichever comes first
            raise not_text(path, at, f"byte {err.object[err.start]:#04x}") from None
    if nul >= 0:
        raise not_text(path, offset + nul, "a NUL byte")
    if first and text.startswith(BOM):  # a UTF-8 byte-order mark says how the file is encoded; it is not text
        text = text[1:]
    if text:
        yield text


def not_text(path: Path, offset: int, what: str) -> CorpusError:
    return CorpusError(f"{path} is not UTF-8 text ({what} at byte offset {offset})",
                       "remove it from the corpus or convert it to UTF-8 text (binary data, Latin-1 or UTF-16 "
                       "files tokenize as garbage)")


def lines(path: Path) -> Iterator[str]:
    """The file's lines (each with its "\n", except perhaps the last), read piece by piece."""
    rest = ""
    for text in read_text(path):
        lines = (rest + text).split("\n")
        rest = lines.pop()
        yield from (line + "\n" for line in lines)
    if rest:
        yield rest


def field(path: Path, lineno: int, line: str, name: str) -> str:
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
