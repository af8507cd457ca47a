"""Columnar corpora (pyarrow, the `data` extra): Parquet read by row group, and Arrow IPC files and streams
(Hugging Face `datasets` folders), one text column at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .corpus_base import ARROW_FILE_MAGIC, PARQUET_MAGIC, CorpusError, head, need, short
from .corpus_text import not_text

BATCH_ROWS = 4096  # Parquet / Arrow rows decoded at a time


def parquet_meta(path: Path) -> tuple[Any, list[Any]]:
    """(Arrow schema, row group metadata) of a Parquet file, or one line naming what is wrong with it. The Arrow
    schema names the top-level columns (the Parquet schema names the leaves: `element` for a list column)."""
    pq = need("pyarrow.parquet")
    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError with its own text
        raise CorpusError(f"{path}: unreadable Parquet ({short(err)})",
                          "repair or remove the file (re-download or re-export it)") from None
    return schema, [meta.row_group(g) for g in range(meta.num_row_groups)]


def arrow_schema(path: Path) -> Any:
    with _arrow_reader(path) as reader:
        return reader.schema


class _arrow_reader:
    """An Arrow IPC file or stream (`datasets` writes streams), memory-mapped, as a context manager."""

    def __init__(self, path: Path) -> None:
        pa = need("pyarrow")
        self.path, self.source = path, pa.memory_map(str(path), "r")
        try:
            if head(path, 6) == ARROW_FILE_MAGIC:
                file = pa.ipc.open_file(self.source)
                self.schema, self.batches = file.schema, (file.get_batch(i) for i in range(file.num_record_batches))
            else:
                stream = pa.ipc.open_stream(self.source)
                self.schema, self.batches = stream.schema, iter(stream)
        except Exception as err:
            self.source.close()
            raise CorpusError(f"{path}: unreadable Arrow file ({short(err)})",
                              "repair or remove the file (save the dataset again)") from None

    def __enter__(self) -> _arrow_reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.source.close()


def require_column(path: Path, schema: Any, name: str, option: str) -> None:
    """The column `name` exists and holds text (any of Arrow's string encodings), or one line saying what to do."""
    columns = list(schema.names)
    if name not in columns:
        raise CorpusError(f"{path}: no column {name!r} (has {columns[:20]})", f"set {option} to the text column")
    _check_text_type(path, name, schema.field(name).type, "", option)


def _is_text(pa: Any, kind: Any) -> bool:
    """A string column in any encoding pandas and Polars write: plain, large, view, or dictionary of those."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # string_view: pyarrow >= 16
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind))


def _check_text_type(path: Path, name: str, kind: Any, where: str, option: str) -> None:
    pa = need("pyarrow")
    if _is_text(pa, kind):
        return
    at = f" in {where}" if where else ""
    if pa.types.is_nested(kind):
        how = (f"take the text field (of {[f.name for f in kind][:10]}) into a column of its own"
               if pa.types.is_struct(kind) else "join each row's strings into one string column")
        raise CorpusError(f"{path}: column {name!r} is nested ({kind}){at}, not a string column",
                          f"{how} (pyarrow.compute or pandas) and set {option} to that column")
    raise CorpusError(f"{path}: column {name!r} is of type {kind}{at}, not text",
                      f"set {option} to a string column")


def table_texts(path: Path, column: str, start: int = -1, stop: int = -1, keep_empty: bool = False) -> Iterator[str]:
    """The strings of one column, a batch of rows at a time (a Parquet file: row group by row group, so memory is
    one row group's column at most); nulls and blank strings are not documents. keep_empty: every row, in order
    (a column of pairs, read beside another): blank strings kept, a null refused."""
    if path.suffix == ".parquet" or head(path, 4) == PARQUET_MAGIC:
        pq = need("pyarrow.parquet")
        schema, groups = parquet_meta(path)
        require_column(path, schema, column, "--text-field (data.text_field)")
        file = pq.ParquetFile(path)
        for g in range(max(start, 0), len(groups) if stop < 0 else stop):
            try:
                for batch in file.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=[column]):
                    yield from _strings(path, batch.column(0), column, f"row group {g}", keep_empty)
            except CorpusError:
                raise
            except Exception as err:
                raise CorpusError(f"{path}: unreadable Parquet in row group {g} ({short(err)})",
                                  "repair or remove the file (re-download or re-export it)") from None
        return
    with _arrow_reader(path) as reader:
        require_column(path, reader.schema, column, "--text-field (data.text_field)")
        index = reader.schema.get_field_index(column)
        b = 0
        while True:
            try:
                batch = next(reader.batches, None)
            except Exception as err:
                raise CorpusError(f"{path}: unreadable Arrow data in record batch {b} ({short(err)})",
                                  "repair or remove the file (save the dataset again)") from None
            if batch is None:
                return
            yield from _strings(path, batch.column(index), column, f"record batch {b}", keep_empty)
            b += 1


def _strings(path: Path, column: Any, name: str, where: str, keep_empty: bool) -> Iterator[str]:
    pa = need("pyarrow")
    _check_text_type(path, name, column.type, where, "--text-field (data.text_field)")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())  # dictionary or view encoding: the same strings
    for text in column.to_pylist():
        if text is None and keep_empty:  # skipping it would pair this column's later rows with other rows
            raise CorpusError(f"{path}: a null in column {name!r} ({where})", "fill in or drop the rows with a null "
                              "source or target")
        if text is not None and (keep_empty or text.strip()):
            if "\0" in text:
                raise not_text(path, -1, f"a NUL character in {where}")
            yield text
