"""Reading corpora: text, JSONL (one field, or src/tgt pairs), Parquet, Arrow (Hugging Face `datasets` folders),
gzip / zstd compressed text and JSONL, and pre-tokenized inputs (Megatron-LM indexed datasets, flat token
files, numpy `.npy` token arrays).

A *document* is one JSONL record's field / one Parquet or Arrow row's column, or one whole text file
(`doc_split="file"`), one blank-line-separated paragraph (`"paragraph"`), or one line (`"line"`); of a
Megatron dataset, one document of its index; of a flat token file or `.npy`, the tokens between two EOS
tokens. Directories are walked in sorted order so the document sequence, and hence every prepared shard, is
reproducible. Formats are recognised by their first bytes (gzip, zstd, Parquet, Arrow, `MMIDIDX`, `.npy`),
not only by the name, so a `.gz` that is not gzip (or gzip without the suffix) is read as what it is.

The unit of map work (`Unit`) is a whole file, except for Parquet (a range of row groups) and Megatron
datasets (a range of documents): a large file becomes several map tasks.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import io
import itertools
import json
import struct
import zlib
from collections.abc import Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from meshformer.errors import MeshformerError

BUNDLED_CORPORA = {"bundled:kjv": Path(__file__).resolve().parent / "corpus" / "kjv-chapters.jsonl.gz"}
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".jsonl", ".json"}
COMPRESSED_SUFFIXES = {".gz", ".zst", ".zstd"}
TABLE_SUFFIXES = {".parquet", ".arrow"}
TOKEN_SUFFIXES = {".idx", ".bin", ".npy"}
DocSplit = Literal["file", "paragraph", "line"]
Format = Literal["text", "jsonl", "parquet", "arrow", "megatron", "tokens"]
TOKEN_FORMATS = ("megatron", "tokens")
_HEAD_BYTES = 1 << 16  # head of each file checked before any work starts
_CHUNK_BYTES = 1 << 22  # pieces in which files are read and checked
_BATCH_ROWS = 4096  # Parquet / Arrow rows decoded at a time
_TOKEN_BLOCK = 1 << 24  # tokens of a flat token file read at a time
MAX_DOC_TOKENS = 1 << 22  # a run of a flat token file without EOS longer than this is cut into documents
UNIT_BYTES = 256 << 20  # about this much input (uncompressed text, or tokens) per map task of a large file
BOM = "\ufeff"
_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
_MEGATRON = b"MMIDIDX\x00\x00"
_NPY = b"\x93NUMPY"
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                    8: np.uint16}
EXTRA_HINT = "pip install 'meshformer[data]'"


class CorpusError(MeshformerError, ValueError):
    """An input corpus that cannot be read as documents."""


@dataclass(frozen=True)
class Unit:
    """One map task's input: a file of a format, and for Parquet a row-group range, for Megatron a document
    range (`start`, `stop`; -1 for the whole file). Saved in the plan as a list."""

    path: str
    format: str
    start: int = -1
    stop: int = -1

    def as_list(self) -> list:
        return [self.path, self.format, self.start, self.stop]

    def where(self) -> str:
        if self.start < 0:
            return self.path
        what = "row groups" if self.format == "parquet" else "documents"
        return f"{self.path} ({what} {self.start}-{self.stop - 1})"


def need(module: str) -> Any:
    """Import an optional dependency of the `data` extra, or say in one line how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(f"reading this input needs the Python package {module.split('.')[0]!r}, which is not "
                          "installed", f"install the data extra: {EXTRA_HINT}") from None


def resolve_inputs(inputs: str | Path | list[str | Path]) -> list[Path]:
    """Expand bundled names, directories and Megatron prefixes into a sorted, de-duplicated list of files.

    In a directory: text/JSONL files (optionally .gz/.zst), Parquet, Arrow, `.npy` and Megatron `.idx` (its
    `.bin` goes with it); flat `.bin` token files only when named (a folder's .bin may be anything); a Hugging Face
    `save_to_disk` folder contributes its Arrow files in the order its state.json lists them."""
    items = inputs if isinstance(inputs, list) else [inputs]
    files: list[Path] = []
    for item in items:
        if str(item) in BUNDLED_CORPORA:
            files.append(BUNDLED_CORPORA[str(item)])
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = _walk(path)
            if not found:
                raise CorpusError(f"directory {path} holds no text files ({sorted(TEXT_SUFFIXES)}, optionally .gz or "
                                  f".zst), Parquet, Arrow or token files ({sorted(TOKEN_SUFFIXES)})",
                                  "add text files or point at another folder")
            files.extend(found)
        elif path.is_file():
            files.append(path.with_suffix(".idx") if path.suffix == ".bin" and _is_megatron_bin(path) else path)
        elif path.with_name(path.name + ".idx").is_file():  # a Megatron prefix, as Megatron's --data-path names it
            files.append(path.with_name(path.name + ".idx"))
        else:
            raise CorpusError(f"corpus input {str(item)!r} does not exist; pass a file, a directory, a Megatron "
                              f"dataset prefix, or one of {sorted(BUNDLED_CORPORA)}")
    return list(dict.fromkeys(files))


def _walk(folder: Path) -> list[Path]:
    """A folder's input files in sorted order; a `datasets` folder's Arrow files in its own order, at its place."""
    hf = {p.parent: p for p in folder.rglob("state.json") if (p.parent / "dataset_info.json").is_file()}
    found: list[tuple[Path, list[Path]]] = [(parent, _hf_files(parent, state)) for parent, state in hf.items()]
    for p in folder.rglob("*"):
        if p.is_file() and p.name != "dataset_dict.json" and not hf.keys() & set(p.parents) and _is_input(p):
            found.append((p, [p]))
    return [f for _, files in sorted(found) for f in files]


def _hf_files(folder: Path, state: Path) -> list[Path]:
    """The Arrow files of a `datasets` save_to_disk folder, in its own order (state.json's `_data_files`)."""
    try:
        names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise CorpusError(f"{state}: not a Hugging Face datasets state.json (no _data_files list)",
                          "save the dataset again with save_to_disk, or pass its .arrow files") from None
    from meshformer.folders import inside

    return [inside(folder, n, what=str(state), fix="save the dataset again with save_to_disk") for n in names]


def _is_input(path: Path) -> bool:
    if path.suffix in TABLE_SUFFIXES or path.suffix in (".idx", ".npy"):
        return True
    return _is_text(path)  # not .bin: a Megatron .bin is read through its .idx, and a flat one is named explicitly


def _is_megatron_bin(path: Path) -> bool:
    return path.with_suffix(".idx").is_file()


def _head(path: Path, n: int = 8) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def detect(path: Path) -> Format:
    """The format of a file, from its first bytes (and its name where bytes cannot tell: text vs JSONL, flat .bin)."""
    head = _head(path, 9)
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"ARROW1") or (head.startswith(b"\xff\xff\xff\xff") and path.suffix == ".arrow"):
        return "arrow"
    if head.startswith(_MEGATRON):
        return "megatron"
    if head.startswith(_NPY) or path.suffix in (".bin", ".npy"):
        return "tokens"
    if path.suffix == ".idx":
        raise CorpusError(f"{path} is not a Megatron index (no MMIDIDX header: starts with {head!r})",
                          "pass the .idx written by Megatron-LM's preprocess_data.py (or IndexedDatasetBuilder)")
    if path.suffix in TABLE_SUFFIXES:
        raise CorpusError(f"{path} is not a {path.suffix[1:]} file (starts with {head[:8]!r})",
                          "repair or remove the file (re-download or re-export it)")
    return "jsonl" if _is_jsonl(path) else "text"


def plan_units(files: list[Path]) -> list[Unit]:
    """The map tasks of these files: one per file, several per large Parquet file or Megatron dataset."""
    units: list[Unit] = []
    for path in files:
        fmt = detect(path)
        if fmt == "parquet":
            sizes = [g.total_byte_size for g in _parquet(path)[1]]
            units += [Unit(str(path), fmt, a, b) for a, b in _ranges(sizes)]
        elif fmt == "megatron":
            per_doc = megatron_index(path).document_bytes()
            units += [Unit(str(path), fmt, a, b) for a, b in _ranges(per_doc)]
        else:
            units.append(Unit(str(path), fmt))
    return units


def _ranges(sizes: Any) -> list[tuple[int, int]]:
    """Consecutive ranges of items holding about UNIT_BYTES each (at least one item per range)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(sizes) == 0:
        return [(0, 0)]
    ends = np.cumsum(sizes)
    cuts = [0]
    while cuts[-1] < len(sizes):
        base = ends[cuts[-1] - 1] if cuts[-1] else 0
        cuts.append(max(cuts[-1] + 1, int(np.searchsorted(ends, base + UNIT_BYTES, side="right"))))
    cuts[-1] = len(sizes)
    return list(itertools.pairwise(cuts))


def unit_bytes(unit: Unit) -> int:
    """About how much input a unit holds (for the number of shuffle buckets)."""
    path = Path(unit.path)
    if unit.format == "parquet":
        groups = _parquet(path)[1]
        return sum(groups[g].total_byte_size for g in range(unit.start, unit.stop))
    if unit.format == "megatron":
        return int(megatron_index(path).document_bytes()[unit.start:unit.stop].sum())
    return path.stat().st_size


def check_corpus(files: list[Path], text_field: str | None = "text") -> None:
    """Refuse, naming the file, what would tokenize as garbage or nothing: binary (or UTF-16) files, an
    all-empty corpus, JSONL whose first record lacks the text field, Parquet/Arrow without the text column, a
    Megatron index that does not match its .bin. Reads only the head of each file (the rest is checked as it is
    read: `read_text`, `iter_unit`)."""
    has_text = False
    for path in files:
        fmt = detect(path)
        if fmt in ("parquet", "arrow"):
            columns = _parquet(path)[0] if fmt == "parquet" else _arrow_columns(path)
            if text_field:
                _require_column(path, columns, text_field, "data.text_field or --text-field")
            has_text = True
            continue
        if fmt in TOKEN_FORMATS:
            if fmt == "megatron":
                megatron_index(path)
            else:
                token_array(path, np.dtype("<u2"))  # checks the header / size; the real dtype is checked in prepare
            has_text = True
            continue
        with closing(read_text(path, _HEAD_BYTES)) as pieces:
            head = next(pieces, "")
            lines = head.splitlines()
            complete = len(lines) > 1 or next(pieces, None) is None  # the first record was read whole
        has_text = has_text or bool(head.strip())
        if text_field and fmt == "jsonl" and complete:
            lineno, first = next(((i, line) for i, line in enumerate(lines, 1) if line.strip()), (0, ""))
            if first:
                _field(path, lineno, first, text_field)
    if not has_text:
        raise CorpusError(f"the corpus {[str(f) for f in files][:3]} holds no text (empty files)",
                          "point data.corpus (or the inputs of `data prepare`) at files that hold text")


def _open_raw(path: Path) -> Any:
    """The file's bytes, decompressed by what its first bytes say (gzip, zstd), whatever its name."""
    head = _head(path, 4)
    if head.startswith(_GZIP):
        return gzip.open(path, "rb")
    if head.startswith(_ZSTD):
        return _ZstdReader(path)
    if path.suffix in COMPRESSED_SUFFIXES and head:
        raise CorpusError(f"{path}: cannot be read (named {path.suffix} but not {path.suffix[1:]} data: starts "
                          f"with {head!r})", "repair or remove the file (or rename it if it is plain text)")
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


def read_text(path: Path, chunk_bytes: int = _CHUNK_BYTES) -> Generator[str, None, None]:
    """The file's text in pieces of about `chunk_bytes` bytes (decompressed if gzip or zstd), newlines as "\n",
    without a leading UTF-8 byte-order mark. Every byte is checked: a byte that is not UTF-8, or a NUL, stops the
    read with the file and its byte offset (in the decompressed text); a truncated or corrupt compressed file
    stops it with the offset reached."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    offset = 0  # bytes of the file decoded before `raw`
    first = True
    try:
        with _open_raw(path) as fh:
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


def _plain_name(path: Path) -> str:
    return path.name.rsplit(".", 1)[0] if path.suffix in COMPRESSED_SUFFIXES else path.name


def _is_text(path: Path) -> bool:
    return Path(_plain_name(path)).suffix in TEXT_SUFFIXES


def _is_jsonl(path: Path) -> bool:
    return _plain_name(path).endswith((".jsonl", ".json"))


def iter_documents(files: list[Path], text_field: str = "text", doc_split: DocSplit = "file") -> Iterator[str]:
    """The documents of text, JSONL, Parquet and Arrow files, in order."""
    for path in files:
        for unit in plan_units([path]):
            yield from iter_unit(unit, text_field, doc_split)  # type: ignore[misc]


def iter_unit(unit: Unit, text_field: str = "text", doc_split: DocSplit = "file", eos_id: int = -1,
              token_dtype: str = "uint16") -> Iterator[str | np.ndarray]:
    """The documents of one map task: strings, or for pre-tokenized inputs int64 token arrays (without the EOS
    that separates documents: packing puts it back)."""
    path = Path(unit.path)
    if unit.format == "parquet":
        yield from _table_texts(path, text_field, unit.start, unit.stop)
    elif unit.format == "arrow":
        yield from _table_texts(path, text_field)
    elif unit.format == "megatron":
        yield from megatron_index(path).documents(unit.start, unit.stop, eos_id)
    elif unit.format == "tokens":
        yield from _split_at_eos(path, token_array(path, np.dtype(token_dtype)), eos_id)
    elif unit.format == "jsonl":
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
        fmt = detect(path)
        if fmt in ("parquet", "arrow"):
            yield from zip(_table_texts(path, src_field, keep_empty=True), _table_texts(path, tgt_field,
                                                                                          keep_empty=True))
            continue
        if fmt != "jsonl":
            raise CorpusError(f"{path}: source/target pairs must come from JSONL, Parquet or Arrow with "
                              f"{src_field!r} and {tgt_field!r} fields")
        for lineno, line in enumerate(_lines(path), 1):
            if line.strip():
                yield _field(path, lineno, line, src_field), _field(path, lineno, line, tgt_field)


# --- Parquet and Arrow (pyarrow, the `data` extra) ---------------------------------------------------------------

def _parquet(path: Path) -> tuple[list[str], list[Any]]:
    """(column names, row group metadata) of a Parquet file, or one line naming what is wrong with it."""
    pq = need("pyarrow.parquet")
    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError with its own text
        raise CorpusError(f"{path}: unreadable Parquet ({_short(err)})",
                          "repair or remove the file (re-download or re-export it)") from None
    return list(meta.schema.names), [meta.row_group(g) for g in range(meta.num_row_groups)]


def _arrow_columns(path: Path) -> list[str]:
    with _arrow_reader(path) as reader:
        return list(reader.schema.names)


class _arrow_reader:
    """An Arrow IPC file or stream (`datasets` writes streams), memory-mapped, as a context manager."""

    def __init__(self, path: Path) -> None:
        pa = need("pyarrow")
        self.path, self.source = path, pa.memory_map(str(path), "r")
        try:
            if _head(path, 6) == b"ARROW1":
                file = pa.ipc.open_file(self.source)
                self.schema, self.batches = file.schema, (file.get_batch(i) for i in range(file.num_record_batches))
            else:
                stream = pa.ipc.open_stream(self.source)
                self.schema, self.batches = stream.schema, iter(stream)
        except Exception as err:
            self.source.close()
            raise CorpusError(f"{path}: unreadable Arrow file ({_short(err)})",
                              "repair or remove the file (save the dataset again)") from None

    def __enter__(self) -> _arrow_reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.source.close()


def _require_column(path: Path, columns: list[str], name: str, option: str) -> None:
    if name not in columns:
        raise CorpusError(f"{path}: no column {name!r} (has {columns[:20]})", f"set {option} to the text column")


def _table_texts(path: Path, column: str, start: int = -1, stop: int = -1, keep_empty: bool = False) -> Iterator[str]:
    """The strings of one column, a batch of rows at a time (a Parquet file: row group by row group, so memory is
    one row group's column at most); nulls and blank strings are not documents."""
    if path.suffix == ".parquet" or _head(path, 4) == b"PAR1":
        pq = need("pyarrow.parquet")
        names, groups = _parquet(path)
        _require_column(path, names, column, "--text-field (data.text_field)")
        file = pq.ParquetFile(path)
        for g in range(max(start, 0), len(groups) if stop < 0 else stop):
            try:
                for batch in file.iter_batches(batch_size=_BATCH_ROWS, row_groups=[g], columns=[column]):
                    yield from _strings(path, batch.column(0), f"row group {g}", keep_empty)
            except CorpusError:
                raise
            except Exception as err:
                raise CorpusError(f"{path}: unreadable Parquet in row group {g} ({_short(err)})",
                                  "repair or remove the file (re-download or re-export it)") from None
        return
    with _arrow_reader(path) as reader:
        _require_column(path, list(reader.schema.names), column, "--text-field (data.text_field)")
        index = reader.schema.get_field_index(column)
        b = 0
        while True:
            try:
                batch = next(reader.batches, None)
            except Exception as err:
                raise CorpusError(f"{path}: unreadable Arrow data in record batch {b} ({_short(err)})",
                                  "repair or remove the file (save the dataset again)") from None
            if batch is None:
                return
            yield from _strings(path, batch.column(index), f"record batch {b}", keep_empty)
            b += 1


def _strings(path: Path, column: Any, where: str, keep_empty: bool) -> Iterator[str]:
    pa = need("pyarrow")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise CorpusError(f"{path}: the text column is of type {column.type} in {where}, not text",
                          "set --text-field (data.text_field) to a string column")
    for text in column.to_pylist():
        if text is not None and (keep_empty or text.strip()):
            if "\0" in text:
                raise _not_text(path, -1, f"a NUL character in {where}")
            yield text


def _short(err: BaseException) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


# --- pre-tokenized inputs ----------------------------------------------------------------------------------------

def megatron_index(idx: Path) -> MegatronIndex:
    """The dataset's index, opened and checked once per process while its files are unchanged (a large dataset is
    many map tasks, each of which would otherwise check the whole index again)."""
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None for p in (idx, idx.with_suffix(".bin"))]
    return _cached_index(str(idx), tuple(stats))


@functools.lru_cache(maxsize=8)
def _cached_index(idx: str, stats: tuple) -> MegatronIndex:
    return MegatronIndex(Path(idx))


class MegatronIndex:
    """A Megatron-LM indexed dataset (`MMIDIDX` `.idx` + `.bin`), checked against its `.bin` when opened:
    header, dtype code, the index's size, sequence pointers (contiguous, as Megatron writes them) and the
    `.bin` size. Document k is sequences document_indices[k] .. document_indices[k + 1]."""

    def __init__(self, idx: Path) -> None:
        self.idx, self.bin = idx, idx.with_suffix(".bin")
        size = idx.stat().st_size
        with open(idx, "rb") as fh:
            head = fh.read(34)
        fix = "re-run Megatron's preprocess_data.py, or restore the matching .idx/.bin pair"
        if len(head) < 34 or not head.startswith(_MEGATRON):
            raise CorpusError(f"{idx}: not a Megatron index (bad header at byte offset 0)", fix)
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in _MEGATRON_DTYPES:
            raise CorpusError(f"{idx}: unknown Megatron index version {version} / dtype code {code} (byte offset 9)",
                              fix)
        self.dtype = np.dtype(_MEGATRON_DTYPES[code])
        body = 34 + 12 * n_seq + 8 * n_doc
        if size not in (body, body + n_seq):  # + one int8 mode per sequence in multimodal indexes
            raise CorpusError(f"{idx}: {size} bytes, but its header promises {n_seq} sequences and {n_doc} document "
                              f"indices ({body} bytes): truncated or not an index", fix)
        mm = np.memmap(idx, mode="r")
        self.lengths = np.frombuffer(mm, np.int32, n_seq, 34)
        self.pointers = np.frombuffer(mm, np.int64, n_seq, 34 + 4 * n_seq)
        self.doc_index = np.frombuffer(mm, np.int64, n_doc, 34 + 12 * n_seq)
        if not self.bin.is_file():
            raise CorpusError(f"{idx}: its data file {self.bin.name} is missing", fix)
        self._check(fix)

    def _check(self, fix: str) -> None:
        n = len(self.lengths)
        item = self.dtype.itemsize
        bin_size = self.bin.stat().st_size
        step = 1 << 22
        expected = 0
        for lo in range(0, n, step):  # pointers must be the running sum of lengths: in pieces (bounded memory)
            lengths = self.lengths[lo:lo + step].astype(np.int64) * item
            want = expected + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            bad = np.flatnonzero((want != self.pointers[lo:lo + step]) | (lengths < 0))
            if len(bad):
                raise CorpusError(f"{self.idx} does not match {self.bin.name}: sequence {lo + int(bad[0])} points to "
                                  f"byte offset {int(self.pointers[lo + bad[0]])}, expected {int(want[bad[0]])}", fix)
            expected += int(lengths.sum())
        if expected != bin_size:
            raise CorpusError(f"{self.idx} does not match {self.bin.name}: the index covers {expected} bytes but the "
                              f".bin holds {bin_size} (byte offset {min(expected, bin_size)})", fix)
        d = self.doc_index
        if len(d) == 0 or d[0] != 0 or d[-1] != n or (len(d) > 1 and bool(np.any(np.diff(d) < 0))):
            raise CorpusError(f"{self.idx}: its document indices do not cover its {n} sequences in order", fix)

    def document_bytes(self) -> np.ndarray:
        """Bytes of every document (document k: its sequences' tokens)."""
        ends = np.concatenate([[0], np.cumsum(self.lengths.astype(np.int64))])
        return (ends[self.doc_index[1:]] - ends[self.doc_index[:-1]]) * self.dtype.itemsize

    def documents(self, start: int, stop: int, eos_id: int) -> Iterator[np.ndarray]:
        data = np.memmap(self.bin, dtype=self.dtype, mode="r")
        item = self.dtype.itemsize
        for k in range(start, stop):
            s0, s1 = int(self.doc_index[k]), int(self.doc_index[k + 1])
            if s1 == s0:
                continue
            lo = int(self.pointers[s0]) // item
            hi = int(self.pointers[s1 - 1]) // item + int(self.lengths[s1 - 1])
            doc = _as_ids(self.idx, data[lo:hi], f"document {k}")
            if len(doc) and doc[-1] == eos_id:  # Megatron's --append-eod: packing adds the EOS back
                doc = doc[:-1]
            if len(doc):
                yield doc


def token_array(path: Path, dtype: np.dtype) -> np.ndarray:
    """A flat token file as a memory map: `.npy` (its header says the dtype), or raw tokens of `dtype`."""
    fix = "pass a file of whole tokens (nanoGPT's train.bin: --token-dtype uint16; .npy: a 1-D integer array)"
    if _head(path, 6) == _NPY:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise CorpusError(f"{path}: unreadable .npy ({_short(err)})", fix) from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise CorpusError(f"{path}: a {arr.ndim}-D {arr.dtype} array, not a 1-D integer token array", fix)
        return arr
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise CorpusError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens (byte offset "
                          f"{size - size % dtype.itemsize})", fix)
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _split_at_eos(path: Path, tokens: np.ndarray, eos_id: int) -> Iterator[np.ndarray]:
    """Documents of a flat token stream: the runs between EOS tokens, a block at a time (runs longer than
    MAX_DOC_TOKENS are cut, so memory stays bounded for a file without EOS)."""
    carry = np.zeros(0, np.int64)
    for lo in range(0, len(tokens), _TOKEN_BLOCK):
        block = _as_ids(path, tokens[lo:lo + _TOKEN_BLOCK], "flat tokens", lo)
        cuts = np.flatnonzero(block == eos_id)
        start = 0
        for cut in cuts.tolist():
            doc = np.concatenate([carry, block[start:cut]]) if len(carry) else block[start:cut]
            carry = np.zeros(0, np.int64)
            start = cut + 1
            if len(doc):
                yield doc
        carry = np.concatenate([carry, block[start:]])
        while len(carry) > MAX_DOC_TOKENS:
            yield carry[:MAX_DOC_TOKENS]
            carry = carry[MAX_DOC_TOKENS:]
    if len(carry):
        yield carry


def _as_ids(path: Path, tokens: np.ndarray, where: str, base: int = 0) -> np.ndarray:
    """Token ids as int64; negative or fractional values stop with the file and position."""
    if tokens.dtype.kind == "f":
        ids = tokens.astype(np.int64)
        bad = np.flatnonzero(ids != tokens)
        if len(bad):
            raise CorpusError(f"{path}: {where}: token {base + int(bad[0])} is {tokens[bad[0]]}, not a token id",
                              "store token ids as integers")
    else:
        ids = np.asarray(tokens, dtype=np.int64)
    if len(ids) and int(ids.min()) < 0:
        neg = int(np.flatnonzero(ids < 0)[0])
        raise CorpusError(f"{path}: {where}: negative token id {int(ids[neg])} (token {base + neg})",
                          "check the dtype of the file (--token-dtype) or re-tokenize it")
    return ids


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
