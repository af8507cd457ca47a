"""Text corpora: plain text and JSONL, gzip or zstd compressed (recognised by their first bytes), read in pieces
with every byte checked (UTF-8, no NUL) and errors that name the file and the byte offset."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import re
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
            if self.dec.eof:  # a frame ended; another may follow (pzstd writes several)
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


def not_text(path: Path | str, offset: int, what: str) -> CorpusError:
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


def field(path: Path | str, lineno: int, line: str, name: str) -> str:
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
    text = record[name]
    # a JSON \uXXXX escape (the only way a decoded line holds one) can spell half a UTF-16 pair: not Unicode text,
    # which UTF-8 and the tokenizers refuse
    if "\\u" in line and (lone := _SURROGATE.search(text)):
        raise CorpusError(f"{path}:{lineno}: field {name!r} holds a lone UTF-16 surrogate (\\u{ord(lone[0]):04x}), "
                          "which is not Unicode text", "fix or drop that record (a surrogate escape comes as a "
                          "high-low pair, e.g. \\ud83d\\ude00)")
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


# --- multi-frame zstd, split by frames ---------------------------------------------------------------------------
# pzstd (and concatenated zstd outputs) hold several independent frames, so a map task can start decompressing
# at any frame. Frame boundaries fall anywhere in a line, so a task owns the lines that *start* in its frames: it
# skips a first line begun in the frame before (whose last byte it decompresses to know), and reads past its last
# frame to finish its last line. One gzip stream (or one zstd frame) cannot be entered in the middle: such files
# stay one map task each (decompressing from the start to skip would cost each task every earlier task's work).

_SKIPPABLE = range(0x184D2A50, 0x184D2A60)


def zstd_frames(path: Path) -> list[tuple[int, int, int]]:
    """(compressed offset, compressed size, decompressed size or -1 where the header does not say) of each frame,
    from frame and block headers only; [] when the file is not a clean sequence of frames (it is then read whole,
    and reading reports what is wrong)."""
    frames = []
    size = path.stat().st_size
    with open(path, "rb") as fh:
        offset = 0
        while offset < size:
            fh.seek(offset)
            header = fh.read(18)
            if len(header) >= 8 and int.from_bytes(header[:4], "little") in _SKIPPABLE:
                offset += 8 + int.from_bytes(header[4:8], "little")
                continue
            if not header.startswith(ZSTD_MAGIC) or len(header) < 6:
                return []
            descriptor = header[4]
            single_segment = descriptor >> 5 & 1
            size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
            at = 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3]
            content = int.from_bytes(header[at:at + size_bytes], "little") + (256 if size_bytes == 2 else 0)
            block = offset + at + size_bytes
            while True:  # block headers: 3 bytes, last-block flag, type (1: RLE, one byte), size
                fh.seek(block)
                raw = fh.read(3)
                if len(raw) < 3:
                    return []
                bits = int.from_bytes(raw, "little")
                block += 3 + (1 if bits >> 1 & 3 == 1 else bits >> 3)
                if bits & 1:
                    break
            end = block + 4 * (descriptor >> 2 & 1)  # content checksum
            frames.append((offset, end - offset, content if size_bytes else -1))
            offset = end
    return frames if offset == size else []


def zstd_frame_lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, str]]:
    """(line number in the range, line) of the lines that start in frames start..stop-1 of a multi-frame zstd
    file; the same lines, in order, as reading the whole file gives, split between the ranges."""
    frames = zstd_frames(path)
    where = f"{path} (zstd frames {start}-{stop - 1})"
    with open(path, "rb") as fh:
        skip = _last_byte_before(fh, path, frames, start) != b"\n"  # the first line began before: its task reads it
        pending, offset, lineno = b"", 0, 0
        for k in range(start, len(frames)):
            if k == stop and (not pending or skip):
                return  # the range ends on a line boundary, or its only line began before it
            for piece in _frame_output(fh, path, frames[k]):
                *complete, rest = (pending + piece).split(b"\n")
                for raw in complete[:1] if k >= stop else complete:
                    if not skip:
                        lineno += 1
                        yield lineno, _line_text(where, raw, offset, start == 0 and lineno == 1)
                    skip = False
                    offset += len(raw) + 1
                if k >= stop and complete:
                    return
                pending = rest
        if pending and not skip:
            yield lineno + 1, _line_text(where, pending, offset, start == 0 and lineno == 0)


def _last_byte_before(fh: Any, path: Path, frames: list[tuple[int, int, int]], start: int) -> bytes:
    """The last decompressed byte before frame `start` ("\n" at the file's start): empty frames (an empty file's,
    in concatenated outputs) are passed over, since they say nothing about where the line before ends."""
    for frame in reversed(frames[:start]):
        if last := b"".join(_frame_output(fh, path, frame))[-1:]:
            return last
    return b"\n"


def _frame_output(fh: Any, path: Path, frame: tuple[int, int, int]) -> Iterator[bytes]:
    zstd = need("zstandard")
    offset, size, _ = frame
    decompressor = zstd.ZstdDecompressor().decompressobj()
    fh.seek(offset)
    for at in range(0, size, 1 << 20):
        try:
            yield decompressor.decompress(fh.read(min(1 << 20, size - at)))
        except zstd.ZstdError as err:
            raise CorpusError(f"{path}: cannot be read: corrupt zstd data ({err}) in the frame at compressed byte "
                              f"offset {offset}", "repair or remove the file (re-download it, or recompress it with "
                              "zstd)") from None


def _line_text(where: str, raw: bytes, offset: int, first: bool) -> str:
    if b"\0" in raw:
        raise not_text(where, offset + raw.index(b"\0"), "a NUL byte")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise not_text(where, offset + err.start, f"byte {raw[err.start]:#04x}") from None
    return (text[1:] if first and text.startswith(BOM) else text).removesuffix("\r") + "\n"
