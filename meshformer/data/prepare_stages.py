"""The two stages of `data prepare`, each a deterministic function of (plan, one unit of work).

map (one unit: an input file, or a row-group range of a large Parquet file or a document range of a Megatron
dataset): stream its documents, choose each one's split and bucket, tokenize in batches (`encode_batch`;
pre-tokenized inputs keep their ids, checked against the vocabulary), and append the token ids to the unit's
spill (`<work>/map/uNNNNNN.<split>.tok`, with a `.docs` table of (bucket, length, target length) per
document). Documents are buffered a chunk at a time and written grouped by bucket (a stable sort), so a
bucket's documents keep their input order.

reduce (one bucket of one split): gather the bucket's documents from every file's spill in file order,
shuffle them with rng(seed, split, bucket), join them with EOS and cut records (or keep pairs), and write the
bucket's shards. Memory is one chunk (map) or one bucket (reduce), whatever the corpus size.

Split: document i of file u is held out when floor(t + (i+1)f) > floor(t + i f), with t = rng(seed, u) in
[0, 1) and f the eval fraction (systematic sampling: each document with probability f, and each file holds
out round(n f) documents within one). Bucket: rng(seed, u) draws a uniform number per document. Neither
depends on how files are spread over processes or machines, which makes the output independent of N.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .shards import write_shards
from .sources import CorpusError, Unit, iter_pairs, iter_unit
from .tokenizer import Tokenizer

_SPLIT_SALT, _SHUFFLE_SALT = 0x5350, 0x5348
_CHUNK_DOCS, _CHUNK_CHARS = 1 << 16, 1 << 25  # one map buffer: bounded by count and by text size
_EXTS = ("tok", "docs", "chunks")
SPLITS = ("train", "eval")


def unit_docs(plan: dict, u: int) -> Iterator:
    """The documents of map task u: strings, (src, tgt) pairs, or token arrays of a pre-tokenized input."""
    unit = Unit(*plan["units"][u])
    if plan["kind"] == "pairs":
        return iter_pairs([Path(unit.path)], plan["src_field"], plan["tgt_field"])
    return iter_unit(unit, plan["text_field"], plan["doc_split"], plan["eos_id"], plan["token_dtype"])


def unit_fingerprint(plan: dict, u: int) -> list[int]:
    """What a finished map task records of its input, so that a resumed prepare redoes it if the file changed (a
    Megatron dataset: its .idx and the .bin holding the tokens)."""
    path, fmt = Path(plan["units"][u][0]), plan["units"][u][1]
    files = (path, path.with_suffix(".bin")) if fmt == "megatron" else (path,)
    return [n for f in files for n in (f.stat().st_size, f.stat().st_mtime_ns)]


def unit_done(plan: dict, work: Path, u: int) -> bool:
    path = work / "map" / f"u{u:06d}.done.json"
    try:
        return json.loads(path.read_text()).get("input") == unit_fingerprint(plan, u)
    except (OSError, ValueError):
        return False


def split_and_bucket(plan: dict, u: int) -> Iterator[tuple[str, float]]:
    """(split, uniform draw for the bucket) for document 0, 1, ... of file u."""
    rng = np.random.default_rng([plan["seed"], u, _SPLIT_SALT])
    t, f = rng.random(), plan["eval_fraction"]
    i = 0
    while True:
        draws = rng.random(1024)
        for r in draws.tolist():
            held = math.floor(t + (i + 1) * f) > math.floor(t + i * f)
            yield ("eval" if held else "train"), r
            i += 1


def train_documents(plan: dict) -> Iterator[str]:
    """The training split's texts in input order (for training a tokenizer)."""
    for u in range(len(plan["units"])):
        for doc, (split, _) in zip(unit_docs(plan, u), split_and_bucket(plan, u)):
            if split == "train":
                yield from (doc if isinstance(doc, tuple) else (doc,))


def _spill(work: Path, u: int, split: str, ext: str) -> Path:
    return work / "map" / f"u{u:06d}.{split}.{ext}"


def _part(path: Path) -> Path:
    return path.with_name(path.name + ".part")


def map_unit(plan: dict, work: Path, tok: Tokenizer, u: int) -> dict[str, Any]:
    """Tokenize file u into per-split spills grouped by bucket; returns its document and token counts."""
    dtype = np.dtype(plan["dtype"])
    (work / "map").mkdir(parents=True, exist_ok=True)
    handles = {(s, e): open(_part(_spill(work, u, s, e)), "wb") for s in SPLITS for e in _EXTS}
    counts = {s: 0 for s in SPLITS}
    tokens = 0
    try:
        chunk: list = []
        chars = 0
        for i, (doc, (split, r)) in enumerate(zip(unit_docs(plan, u), split_and_bucket(plan, u))):
            if isinstance(doc, np.ndarray) and int(doc.max()) >= tok.vocab_size:
                _too_large(plan, u, i, doc, tok)
            chunk.append((doc, split, int(r * plan["buckets"][split])))
            chars += sum(map(len, doc)) if isinstance(doc, tuple) else len(doc)
            if len(chunk) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
                tokens += _write_chunk(chunk, tok, dtype, handles, counts, plan["buckets"])
                chunk, chars = [], 0
        if chunk:
            tokens += _write_chunk(chunk, tok, dtype, handles, counts, plan["buckets"])
    finally:
        for fh in handles.values():
            fh.close()
    for (s, e) in handles:  # complete files only: a rerun of a killed task starts over
        _part(_spill(work, u, s, e)).rename(_spill(work, u, s, e))
    done = {"documents": counts, "tokens": tokens, "input": unit_fingerprint(plan, u)}
    (work / "map" / f"u{u:06d}.done.json").write_text(json.dumps(done))
    return done


def _too_large(plan: dict, u: int, i: int, doc: np.ndarray, tok: Tokenizer) -> None:
    unit = Unit(*plan["units"][u])
    at = int(np.flatnonzero(doc >= tok.vocab_size)[0])
    first = f"document {unit.start + i}" if unit.format == "megatron" else f"document {i} (EOS-separated)"
    raise CorpusError(f"{unit.path}: {first} holds token id {int(doc[at])} (its token {at}), but tokenizer "
                      f"{tok.name!r} has {tok.vocab_size} tokens", "pass the tokenizer these ids come from "
                      "(--tokenizer; data.tokenizer), or check --token-dtype for flat .bin files")


def _write_chunk(chunk: list, tok: Tokenizer, dtype: np.dtype, handles: dict, counts: dict,
                 buckets: dict[str, int]) -> int:
    """Append one chunk, grouped by bucket; `.chunks` gets where each bucket's rows and tokens start."""
    pairs = isinstance(chunk[0][0], tuple)
    src: list
    if pairs:
        src, tgt = tok.encode_batch([d[0] for d, _, _ in chunk]), tok.encode_batch([d[1] for d, _, _ in chunk])
    elif isinstance(chunk[0][0], np.ndarray):  # pre-tokenized: the ids are taken as they are
        src, tgt = [d for d, _, _ in chunk], [[] for _ in chunk]
    else:
        src, tgt = tok.encode_batch([d for d, _, _ in chunk]), [[] for _ in chunk]
    tokens = 0
    for split in SPLITS:
        idx = [i for i, (_, s, _) in enumerate(chunk) if s == split]
        idx = [idx[k] for k in np.argsort([chunk[i][2] for i in idx], kind="stable")]
        table = np.array([(chunk[i][2], len(src[i]), len(tgt[i])) for i in idx], dtype=np.int64).reshape(-1, 3)
        ids = [np.asarray(x, dtype=dtype) for i in idx for x in (src[i], tgt[i])]
        # where each bucket's rows and tokens start in the unit's files: a reducer reads two entries per chunk
        first = np.searchsorted(table[:, 0], np.arange(buckets[split] + 1))
        token_start = np.concatenate([[0], np.cumsum(table[:, 1] + table[:, 2])])[first]
        token_base = handles[split, "tok"].tell() // dtype.itemsize
        handles[split, "chunks"].write(np.stack([first + counts[split], token_start + token_base]).astype(np.int64)
                                       .tobytes())
        handles[split, "tok"].write(np.concatenate(ids).tobytes() if ids else b"")
        handles[split, "docs"].write(table.tobytes())
        counts[split] += len(idx)
        tokens += int(table[:, 1:].sum())
    return tokens


def _bucket_docs(plan: dict, work: Path, split: str, b: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The bucket's documents as (tokens, target tokens), in file order; reads only their rows and tokens."""
    dtype = np.dtype(plan["dtype"])
    width = plan["buckets"][split] + 1
    docs = []
    for u in range(len(plan["units"])):
        path = _spill(work, u, split, "chunks")
        if path.stat().st_size == 0:  # a file without documents
            continue
        chunks = np.memmap(path, dtype=np.int64, mode="r").reshape(-1, 2, width)
        where = np.array(chunks[:, :, b:b + 2])  # (chunk, rows|tokens, start|end)
        del chunks
        with open(_spill(work, u, split, "docs"), "rb") as table_fh, \
                open(_spill(work, u, split, "tok"), "rb") as tok_fh:
            for (r0, r1), (t0, t1) in where.tolist():
                if r1 == r0:
                    continue
                table_fh.seek(r0 * 24)
                table = np.frombuffer(table_fh.read((r1 - r0) * 24), dtype=np.int64).reshape(-1, 3)
                tok_fh.seek(t0 * dtype.itemsize)
                block = np.frombuffer(tok_fh.read((t1 - t0) * dtype.itemsize), dtype=dtype)
                ends = np.cumsum(table[:, 1] + table[:, 2])
                starts = ends - table[:, 1] - table[:, 2]
                for (_, n_src, _), lo, hi in zip(table.tolist(), starts.tolist(), ends.tolist()):
                    docs.append((block[lo:lo + n_src], block[lo + n_src:hi]))
    return docs


def reduce_bucket(plan: dict, work: Path, split: str, b: int, eos: int) -> dict[str, Any]:
    """Shuffle, pack and write bucket b of `split`; returns its shard list (also saved as JSON)."""
    docs = _bucket_docs(plan, work, split, b)
    perm = np.random.default_rng([plan["seed"], SPLITS.index(split), b, _SHUFFLE_SALT]).permutation(len(docs))
    folder = work / "reduce" / f"{split}-{b:05d}"
    folder.mkdir(parents=True, exist_ok=True)
    result_path = work / "reduce" / f"{split}-{b:05d}.json"
    result_path.unlink(missing_ok=True)  # first: a rerun killed below must not look done to the merge
    for stale in folder.iterdir():
        stale.unlink()
    dtype = np.dtype(plan["dtype"])
    records: Iterable[dict[str, np.ndarray]]
    if plan["kind"] == "pairs":
        records = ({"src": docs[i][0], "tgt": docs[i][1]} for i in perm.tolist())
    else:
        pieces = [x for i in perm.tolist() for x in (docs[i][0], np.array([eos], dtype=dtype))]
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        n = len(stream) // plan["record_len"]
        records = ({"tokens": r} for r in stream[:n * plan["record_len"]].reshape(n, plan["record_len"]))
    shards = write_shards(records, dtype, plan["shard_records"], lambda k: folder / f"{k:06d}.tar")
    result = {"documents": len(docs), "shards": [vars(s) for s in shards]}
    staged = result_path.with_name(result_path.name + ".part")
    staged.write_text(json.dumps(result))
    staged.replace(result_path)  # whole or absent: a kill while writing leaves the task not done
    return result
