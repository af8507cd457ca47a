"""Corpora as map tasks and documents: the front of the readers (corpus_text / corpus_tables / corpus_tokens)
and of folder discovery (corpus_discovery).

A *document* is one JSONL record's field / one Parquet or Arrow row's column, or one whole text file
(`doc_split="file"`), one blank-line-separated paragraph (`"paragraph"`), or one line (`"line"`); of a
Megatron dataset, one document of its index; of a flat token file or `.npy`, the tokens between two EOS
tokens.

The unit of map work (`Unit`) is a whole file, except for Parquet (a range of row groups) and Megatron
datasets (a range of documents): a large file becomes several map tasks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from .corpus_base import BUNDLED_CORPORA, TOKEN_FORMATS, ZSTD_MAGIC, CorpusError, detect, head
from .corpus_discovery import resolve_inputs
from .corpus_tables import arrow_schema, parquet_meta, require_column, table_texts
from .corpus_text import field, lines, read_text, zstd_frame_lines, zstd_frames
from .corpus_tokens import MegatronIndex, megatron_index, split_at_eos, token_array

__all__ = ["BUNDLED_CORPORA", "TOKEN_FORMATS", "CorpusError", "DocSplit", "MegatronIndex", "Unit", "check_corpus",
           "detect", "iter_documents", "iter_pairs", "iter_unit", "plan_units", "read_text", "resolve_inputs",
           "unit_bytes"]

DocSplit = Literal["file", "paragraph", "line"]
UNIT_BYTES = 256 << 20  # about this much input (uncompressed text, or tokens) per map task of a large file
_HEAD_BYTES = 1 << 16  # head of each file checked before any work starts


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
        what = {"parquet": "row groups", "jsonl": "zstd frames"}.get(self.format, "documents")
        return f"{self.path} ({what} {self.start}-{self.stop - 1})"




def plan_units(files: list[Path]) -> list[Unit]:
    """The map tasks of these files: one per file, several per large Parquet file, Megatron dataset or multi-frame
    zstd JSONL file."""
    units: list[Unit] = []
    for path in files:
        fmt = detect(path)
        if fmt == "parquet":
            sizes = [g.total_byte_size for g in parquet_meta(path)[1]]
            units += [Unit(str(path), fmt, a, b) for a, b in _ranges(sizes)]
        elif fmt == "megatron":
            per_doc = megatron_index(path).document_bytes()
            units += [Unit(str(path), fmt, a, b) for a, b in _ranges(per_doc)]
        elif fmt == "jsonl" and head(path, 4) == ZSTD_MAGIC and len(ranges := _ranges(_frame_sizes(path))) > 1:
            units += [Unit(str(path), fmt, a, b) for a, b in ranges]
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


def _frame_sizes(path: Path) -> list[int]:
    """Decompressed bytes per zstd frame (4x the compressed size where a frame's header does not say)."""
    return [content if content >= 0 else 4 * size for _, size, content in zstd_frames(path)]


def unit_bytes(unit: Unit) -> int:
    """About how much input a unit holds (for the number of shuffle buckets)."""
    path = Path(unit.path)
    if unit.format == "parquet":
        groups = parquet_meta(path)[1]
        return sum(groups[g].total_byte_size for g in range(unit.start, unit.stop))
    if unit.format == "megatron":
        return int(megatron_index(path).document_bytes()[unit.start:unit.stop].sum())
    if unit.start >= 0:  # frames of a zstd file: their compressed bytes, as a whole file counts
        return sum(size for _, size, _ in zstd_frames(path)[unit.start:unit.stop])
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
            schema = parquet_meta(path)[0] if fmt == "parquet" else arrow_schema(path)
            if text_field:
                require_column(path, schema, text_field, "data.text_field or --text-field")
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
                field(path, lineno, first, text_field)
    if not has_text:
        raise CorpusError(f"the corpus {[str(f) for f in files][:3]} holds no text (empty files)",
                          "point data.corpus (or the inputs of `data prepare`) at files that hold text")




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
        yield from table_texts(path, text_field, unit.start, unit.stop)
    elif unit.format == "arrow":
        yield from table_texts(path, text_field)
    elif unit.format == "megatron":
        yield from megatron_index(path).documents(unit.start, unit.stop, eos_id)
    elif unit.format == "tokens":
        yield from split_at_eos(path, token_array(path, np.dtype(token_dtype)), eos_id)
    elif unit.format == "jsonl":
        whole = unit.start < 0
        numbered = enumerate(lines(path), 1) if whole else zstd_frame_lines(path, unit.start, unit.stop)
        for lineno, line in numbered:
            if line.strip():
                text = field(path if whole else unit.where(), lineno, line, text_field)
                if text.strip():
                    yield text
    elif doc_split == "file":
        text = "".join(read_text(path))
        if text.strip():
            yield text
    elif doc_split == "line":
        yield from (line.rstrip("\n") for line in lines(path) if line.strip())
    else:
        yield from (p.strip() for p in "".join(read_text(path)).split("\n\n") if p.strip())


def iter_pairs(files: list[Path], src_field: str = "src", tgt_field: str = "tgt") -> Iterator[tuple[str, str]]:
    for path in files:
        fmt = detect(path)
        if fmt in ("parquet", "arrow"):
            yield from zip(table_texts(path, src_field, keep_empty=True), table_texts(path, tgt_field,
                                                                                          keep_empty=True))
            continue
        if fmt != "jsonl":
            raise CorpusError(f"{path}: source/target pairs must come from JSONL, Parquet or Arrow with "
                              f"{src_field!r} and {tgt_field!r} fields")
        for lineno, line in enumerate(lines(path), 1):
            if line.strip():
                yield field(path, lineno, line, src_field), field(path, lineno, line, tgt_field)


