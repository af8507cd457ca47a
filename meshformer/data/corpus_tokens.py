"""Pre-tokenized corpora, read without re-tokenizing: Megatron-LM indexed datasets (`MMIDIDX` `.idx` + `.bin`),
flat token files (`.bin` of uint16/uint32, nanoGPT's train.bin) and numpy `.npy` token arrays."""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .corpus_base import MEGATRON_MAGIC, NPY_MAGIC, CorpusError, head, short

MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}
TOKEN_BLOCK = 1 << 24  # tokens of a flat token file read at a time
MAX_DOC_TOKENS = 1 << 22  # a run of a flat token file without EOS longer than this is cut into documents


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
            header = fh.read(34)
        fix = "re-run Megatron's preprocess_data.py, or restore the matching .idx/.bin pair"
        if len(header) < 34 or not header.startswith(MEGATRON_MAGIC):
            raise CorpusError(f"{idx}: not a Megatron index (bad header at byte offset 0)", fix)
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[9:34])
        if version != 1 or code not in MEGATRON_DTYPES:
            raise CorpusError(f"{idx}: unknown Megatron index version {version} / dtype code {code} (byte offset 9)",
                              fix)
        self.dtype = np.dtype(MEGATRON_DTYPES[code])
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
    if head(path, 6) == NPY_MAGIC:
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise CorpusError(f"{path}: unreadable .npy ({short(err)})", fix) from None
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise CorpusError(f"{path}: a {arr.ndim}-D {arr.dtype} array, not a 1-D integer token array", fix)
        return arr
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise CorpusError(f"{path}: {size} bytes is not a whole number of {dtype.name} tokens (byte offset "
                          f"{size - size % dtype.itemsize})", fix)
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def split_at_eos(path: Path, tokens: np.ndarray, eos_id: int) -> Iterator[np.ndarray]:
    """Documents of a flat token stream: the runs between EOS tokens, a block at a time (runs longer than
    MAX_DOC_TOKENS are cut, so memory stays bounded for a file without EOS)."""
    carry = np.zeros(0, np.int64)
    for lo in range(0, len(tokens), TOKEN_BLOCK):
        block = _as_ids(path, tokens[lo:lo + TOKEN_BLOCK], "flat tokens", lo)
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


