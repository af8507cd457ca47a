"""What every corpus reader shares: the error, optional imports, file signatures and format detection.

Formats are recognised by their first bytes (gzip, zstd, Parquet, Arrow, `MMIDIDX`, `.npy`), not only by the
name, so a `.gz` that is not gzip (or gzip without the suffix) is read as what it is; the name decides only what
bytes cannot tell (text vs JSONL, a flat `.bin` token file).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Literal

from meshformer.errors import MeshformerError

BUNDLED_CORPORA = {"bundled:kjv": Path(__file__).resolve().parent / "corpus" / "kjv-chapters.jsonl.gz"}
TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".jsonl", ".json"}
COMPRESSED_SUFFIXES = {".gz", ".zst", ".zstd"}
TABLE_SUFFIXES = {".parquet", ".arrow"}
TOKEN_SUFFIXES = {".idx", ".bin", ".npy"}
Format = Literal["text", "jsonl", "parquet", "arrow", "megatron", "tokens"]
TOKEN_FORMATS = ("megatron", "tokens")
GZIP_MAGIC, ZSTD_MAGIC = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
PARQUET_MAGIC, ARROW_FILE_MAGIC, ARROW_STREAM_MAGIC = b"PAR1", b"ARROW1", b"\xff\xff\xff\xff"
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
NPY_MAGIC = b"\x93NUMPY"
EXTRA_HINT = "pip install 'meshformer[data]'"


class CorpusError(MeshformerError, ValueError):
    """An input corpus that cannot be read as documents."""


def need(module: str) -> Any:
    """Import an optional dependency of the `data` extra, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise CorpusError(f"reading this input needs the Python package {module.split('.')[0]!r}, which is not "
                          "installed", f"install the data extra: {EXTRA_HINT}") from None


def head(path: Path, n: int = 8) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def short(err: BaseException) -> str:
    """An exception's text on one line, cut to a length that fits an error line."""
    return " ".join(str(err).split())[:200] or type(err).__name__


def plain_name(path: Path) -> str:
    """The file name without a compression suffix (`a.jsonl.zst` -> `a.jsonl`)."""
    return path.name.rsplit(".", 1)[0] if path.suffix in COMPRESSED_SUFFIXES else path.name


def named_as_text(path: Path) -> bool:
    return Path(plain_name(path)).suffix in TEXT_SUFFIXES


def named_as_jsonl(path: Path) -> bool:
    return plain_name(path).endswith((".jsonl", ".json"))


def binary_format(first_bytes: bytes, suffix: str) -> Format | None:
    """The table or token format that a file's first bytes announce, if any."""
    if first_bytes.startswith(PARQUET_MAGIC):
        return "parquet"
    if first_bytes.startswith(ARROW_FILE_MAGIC) or (first_bytes.startswith(ARROW_STREAM_MAGIC) and suffix == ".arrow"):
        return "arrow"
    if first_bytes.startswith(MEGATRON_MAGIC):
        return "megatron"
    if first_bytes.startswith(NPY_MAGIC):
        return "tokens"
    return None


def detect(path: Path) -> Format:
    """The format of a file, from its first bytes (and its name where bytes cannot tell: text vs JSONL, flat .bin)."""
    first = head(path, 9)
    found = binary_format(first, path.suffix)
    if found:
        return found
    if path.suffix in (".bin", ".npy"):
        return "tokens"
    if path.suffix == ".idx":
        raise CorpusError(f"{path} is not a Megatron index (no MMIDIDX header: starts with {first!r})",
                          "pass the .idx written by Megatron-LM's preprocess_data.py (or IndexedDatasetBuilder)")
    if path.suffix in TABLE_SUFFIXES:
        raise CorpusError(f"{path} is not a {path.suffix[1:]} file (starts with {first[:8]!r})",
                          "repair or remove the file (re-download or re-export it)")
    return "jsonl" if named_as_jsonl(path) else "text"
