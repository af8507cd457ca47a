"""`meshformer data prepare`: corpus -> tokenizer -> packed WebDataset shards + manifest.json.

Steps, all deterministic for the same inputs and seed:
1. read documents (sources.py), shuffle them with rng(seed), hold out `eval_fraction` of them;
2. train a byte-level BPE on the training documents, or load a tokenizer (saved as tokenizer.json);
3. tokenize with `num_proc` processes (ordered map, so the process count does not change the output);
4. packed: concatenate documents with EOS separators and cut `record_len`-token records (the ragged tail
   is dropped); pairs: one sample per (src, tgt);
5. write tar shards of `shard_records` records plus manifest.json (counts, sha256, tokenizer hash).
Documents are held in memory for the shuffle: fine for corpora of a few GB of text; split larger ones.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Iterator
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meshformer.errors import MeshformerError, UsageError

from .shards import Manifest, ShardInfo, ShardWriter, token_dtype
from .sources import BUNDLED_CORPORA, CorpusError, DocSplit, check_corpus, iter_documents, iter_pairs, resolve_inputs
from .tokenizer import Tokenizer, load_tokenizer, train_bpe

log = logging.getLogger("meshformer.data")


class OutputExistsError(MeshformerError, FileExistsError):
    """The output folder already holds prepared shards."""

_CHUNK = 256  # documents per tokenization task


def prepare(inputs: str | Path | list[str | Path], out_dir: str | Path, *, tokenizer: str = "train",
            vocab_size: int = 4096, seq_len: int = 128, record_len: int | None = None, text_field: str = "text",
            pairs: bool = False, src_field: str = "src", tgt_field: str = "tgt", doc_split: DocSplit = "file",
            eval_fraction: float = 0.02, seed: int = 1234, shard_records: int | None = None, num_proc: int = 0,
            progress: bool = True, overwrite: bool = False) -> Manifest:
    """Prepare shards in `out_dir` and return the manifest (also written to out_dir/manifest.json).

    tokenizer: "train" (byte-level BPE of `vocab_size` on the training documents), "bundled:<name>",
    "gpt2", or a tokenizer.json path. Records hold `record_len` tokens (default seq_len + 1: one causal
    sequence plus its shifted label; longer records are cut into several samples at load time).
    shard_records: records per shard (default: about 16M tokens per shard). num_proc: tokenizer
    processes (0: in-process, using the tokenizer's own threads).
    """
    out = Path(out_dir)
    if (out / "manifest.json").exists() and not overwrite:
        raise OutputExistsError(f"{out} already holds prepared shards", "pass --overwrite (overwrite=True) or "
                                "choose another output folder")
    if not 0 <= eval_fraction < 1:
        raise UsageError(f"eval_fraction={eval_fraction} is out of range", "use a value in [0, 1), e.g. 0.02")
    record_len = record_len or seq_len + 1
    if record_len < 2:
        raise UsageError(f"record_len={record_len} is too short", "use --seq-len >= 1 (--record-len >= 2)")
    start = time.perf_counter()
    files = resolve_inputs(inputs if isinstance(inputs, list) else [inputs])
    check_corpus(files, None if pairs else text_field)
    if pairs:
        docs: list = list(iter_pairs(files, src_field, tgt_field))
    else:
        docs = list(iter_documents(files, text_field, doc_split))
    if not docs:
        raise CorpusError(f"no documents found in {[str(f) for f in files][:3]}", "check the inputs and --text-field")
    order = np.random.default_rng(seed).permutation(len(docs))
    n_eval = round(len(docs) * eval_fraction) if len(docs) > 1 else 0
    if pairs and eval_fraction > 0 and len(docs) > 1:
        n_eval = max(1, n_eval)
    hold_out_tokens = not pairs and eval_fraction > 0 and n_eval == 0  # too few documents: split the token stream
    split_docs = {"eval": [docs[i] for i in order[:n_eval]], "train": [docs[i] for i in order[n_eval:]]}

    tok = _tokenizer(tokenizer, split_docs["train"], vocab_size, pairs)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save(tmp / "tokenizer.json")
    dtype = token_dtype(tok.vocab_size)
    shard_records = shard_records or max(1, (1 << 24) // (record_len if not pairs else 256))
    splits: dict[str, list[ShardInfo]] = {}
    pool = _pool(tok, num_proc)
    try:
        for name in ("train", "eval"):
            texts = split_docs[name]
            bar = tqdm(total=len(texts), desc=f"tokenize {name}", unit="doc", disable=not progress or not texts)
            encoded = _tokenize(tok, texts, pool, bar)
            samples = encoded if pairs else _pack(encoded, tok.eos_id, record_len)
            if hold_out_tokens and name == "train":
                records = list(samples)
                n_held = max(1, round(len(records) * eval_fraction)) if len(records) > 1 else 0
                splits["eval"] = _write_shards(tmp, "eval", iter(records[len(records) - n_held:]), dtype,
                                               shard_records, pairs)
                samples = iter(records[:len(records) - n_held])
            if name not in splits:
                splits[name] = _write_shards(tmp, name, samples, dtype, shard_records, pairs)
            bar.close()
    finally:
        if pool is not None:
            pool.terminate()
    manifest = Manifest(
        kind="pairs" if pairs else "packed", record_len=0 if pairs else record_len, dtype=dtype.name,
        tokenizer={"spec": tokenizer, "file": "tokenizer.json", "sha256": tok.sha256, "vocab_size": tok.vocab_size,
                   "eos_id": tok.eos_id, "pad_id": tok.pad_id},
        splits=splits,
        meta={"inputs": [_input_name(f) for f in files], "text_field": text_field, "doc_split": doc_split,
              "seed": seed, "eval_fraction": eval_fraction, "documents": {k: len(v) for k, v in split_docs.items()},
              "eval_held_out": "tokens" if hold_out_tokens else "documents",
              "created_by": "meshformer data prepare"})
    (tmp / "manifest.json").write_text(manifest.to_json())
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # readers never see a half-written folder
    manifest.url = str(out / "manifest.json")
    tokens = sum(s.tokens for s in splits["train"])
    log.info("prepared %s: %d train shards, %d train tokens, %d eval shards in %.1fs", out, len(splits["train"]),
             tokens, len(splits["eval"]), time.perf_counter() - start)
    return manifest


def _input_name(path: Path) -> str:
    for name, bundled in BUNDLED_CORPORA.items():
        if path == bundled:
            return name
    return str(path)


def _tokenizer(spec: str, train_docs: list, vocab_size: int, pairs: bool) -> Tokenizer:
    if spec != "train":
        return load_tokenizer(spec)
    texts = [t for pair in train_docs for t in pair] if pairs else train_docs
    return train_bpe(texts, vocab_size=vocab_size)


# ----------------------------------------------------------------------------- tokenizing

_WORKER_TOK: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _WORKER_TOK
    from tokenizers import Tokenizer as HFTokenizer

    _WORKER_TOK = Tokenizer(HFTokenizer.from_str(tokenizer_json), "worker")


def _encode_chunk(texts: list) -> list:
    assert _WORKER_TOK is not None
    return _encode(_WORKER_TOK, texts)


def _encode(tok: Tokenizer, texts: list) -> list:
    if texts and isinstance(texts[0], tuple):
        src = tok.encode_batch([s for s, _ in texts])
        tgt = tok.encode_batch([t for _, t in texts])
        return list(zip(src, tgt))
    return tok.encode_batch(texts)


def _pool(tok: Tokenizer, num_proc: int) -> Pool | None:
    if num_proc <= 1:
        return None
    # spawn: the parent's tokenizer thread pool must not be forked.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return multiprocessing.get_context("spawn").Pool(num_proc, initializer=_init_worker, initargs=(tok.json,))


def _tokenize(tok: Tokenizer, texts: list, pool: Pool | None, bar: tqdm) -> Iterator:
    chunks = [texts[i:i + _CHUNK] for i in range(0, len(texts), _CHUNK)]
    results = pool.imap(_encode_chunk, chunks) if pool is not None else (_encode(tok, c) for c in chunks)
    for chunk, encoded in zip(chunks, results):  # imap keeps input order: output independent of num_proc
        yield from encoded
        bar.update(len(chunk))


def _pack(encoded: Iterator[list[int]], eos: int, record_len: int) -> Iterator[np.ndarray]:
    """Documents joined by EOS, cut into record_len-token records; the ragged tail is dropped."""
    buf: list[int] = []
    for ids in encoded:
        buf.extend(ids)
        buf.append(eos)
        while len(buf) >= record_len:
            yield np.asarray(buf[:record_len], dtype=np.int64)
            del buf[:record_len]


def _write_shards(folder: Path, split: str, samples: Iterator, dtype: np.dtype, per_shard: int,
                  pairs: bool) -> list[ShardInfo]:
    shards: list[ShardInfo] = []
    writer: ShardWriter | None = None
    for sample in samples:
        if writer is None:
            writer = ShardWriter(folder / f"{split}-{len(shards):06d}.tar", dtype)
        if pairs:
            writer.write(src=np.asarray(sample[0]), tgt=np.asarray(sample[1]))
        else:
            writer.write(tokens=sample)
        if writer.samples == per_shard:
            shards.append(writer.close())
            writer = None
    if writer is not None:
        shards.append(writer.close())
    return shards
