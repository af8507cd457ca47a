"""Corpora in the formats they ship in (Parquet, zstd/gzip JSONL, Arrow and `datasets` folders) and pre-tokenized
inputs (Megatron indexed datasets written by megatron-core's own builder, flat .bin and .npy token files): the same
documents, in the same order, as the JSONL they were made from; byte-identical output for any number of parts;
ids kept exactly; a mixture over an imported Megatron source; a prepare that resumes after a corrupt file is fixed.
Every file is written here (pyarrow, zstandard, megatron-core, numpy)."""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from helpers.data import config, kjv_docs, shards, tokenizer

from meshformer.data import build_loader, load_tokenizer, prepare, prepare_stages, read_manifest, sources
from meshformer.data.shards import read_shard
from meshformer.data.sources import (
    CorpusError,
    MegatronIndex,
    Unit,
    iter_pairs,
    iter_unit,
    plan_units,
    resolve_inputs,
)

KW = dict(tokenizer="bundled:kjv-bpe-4k", record_len=33, shard_records=16, eval_fraction=0.1, seed=5,
          bucket_mb=1000, progress=False)
DOCS = kjv_docs(60)


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != ".meshformer"}


def same_shards(a: Path, b: Path) -> bool:
    """Byte-identical shards, indexes and tokenizer, and the same manifest but for the input names."""
    files_a, files_b = folder_bytes(a), folder_bytes(b)
    meta = [json.loads(f.pop("manifest.json")) for f in (files_a, files_b)]
    for m in meta:
        m["meta"].pop("inputs")
    return files_a == files_b and meta[0] == meta[1]


def same_for_any_parts(corpus: Path, tmp_path: Path, whole: Path) -> None:
    """Prepared in 2 and in 3 parts (map, reduce, merge), the output is byte for byte `whole`'s."""
    for n in (2, 3):
        out = tmp_path / f"n{n}"
        for stage in ("map", "reduce"):
            for i in range(n):
                prepare(corpus, out, part=(i, n), stage=stage, **KW)
        prepare(corpus, out, part=(0, n), stage="merge", **KW)
        assert folder_bytes(out) == folder_bytes(whole)


def jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def parquet(path: Path, docs: list[str], rows_per_group: int = 7, column: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, path, row_group_size=rows_per_group)
    return path


def zst(path: Path, data: bytes, frames: int = 3) -> Path:
    """zstd in several frames, as pzstd / zstd -T write it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    step = len(data) // frames + 1
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(data[i:i + step])
                              for i in range(0, len(data), step)))
    return path


def arrow_stream(path: Path, docs: list[str]) -> Path:
    """An Arrow IPC stream in record batches of 5 rows, as `datasets` writes its data-*.arrow files."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"text": docs, "n": list(range(len(docs)))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=5):
            writer.write_batch(batch)
    return path


def hf_folder(folder: Path, parts: list[list[str]], names: list[str]) -> Path:
    """A `datasets` save_to_disk folder: data files listed in state.json (in an order other than sorted)."""
    for docs, name in zip(parts, names):
        arrow_stream(folder / name, docs)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "x", "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return folder


def all_records(out: Path, split: str = "train") -> np.ndarray:
    m = read_manifest(str(out))
    parts = []
    for info in m.splits[split]:
        got = read_shard(m.shard_url(info), info, m.dtype, None)
        parts += [got[i]["tokens"] for i in range(info.samples)]
    return np.concatenate(parts)


# --- raw text formats -------------------------------------------------------------------------------------------

def test_parquet_gives_the_jsonl_output_and_splits_by_row_group(tmp_path, monkeypatch):
    ref = prepare(jsonl(tmp_path / "j" / "c.jsonl", DOCS), tmp_path / "ref", **KW)
    pq_file = parquet(tmp_path / "p" / "c.parquet", DOCS)
    whole = prepare(pq_file, tmp_path / "whole", **KW)  # one map task: the same documents in the same order
    assert same_shards(tmp_path / "whole", tmp_path / "ref")
    assert whole.meta["documents"] == ref.meta["documents"]
    # a large file becomes several map tasks, by row groups; any number of parts gives the same bytes
    monkeypatch.setattr(sources, "UNIT_BYTES", 3 * pq.ParquetFile(pq_file).metadata.row_group(0).total_byte_size)
    units = plan_units([pq_file])
    assert len(units) >= 3 and [(u.start, u.stop) for u in units] == list(zip([0] + [u.stop for u in units[:-1]],
                                                                           [u.stop for u in units]))
    assert units[0].start == 0 and units[-1].stop == 9  # 60 rows / 7 = 9 row groups, each in one task
    assert [d for u in units for d in iter_unit(u)] == DOCS
    split = prepare(pq_file, tmp_path / "n1", **KW)
    assert split.meta["documents"] == ref.meta["documents"]
    same_for_any_parts(pq_file, tmp_path, tmp_path / "n1")


def test_a_null_in_a_parquet_pair_column_is_refused_not_shifted(tmp_path):
    """Pairs come from two columns read side by side: a null in one must not drop that row from one column only,
    pairing every later source with the next row's target."""
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({"src": ["a", "b", "c"], "tgt": ["A", None, "C"]}), path)
    with pytest.raises(CorpusError, match=r"pairs.parquet: a null in column 'tgt' \(row group 0\)"):
        list(iter_pairs([path]))


def test_parquet_text_column_is_configurable(tmp_path):
    path = parquet(tmp_path / "c.parquet", DOCS[:10], column="content")
    with pytest.raises(CorpusError, match=r"no column 'text' \(has \['id', 'content'\]\).*text-field"):
        prepare(path, tmp_path / "o", **KW)
    m = prepare(path, tmp_path / "o", text_field="content", **KW)
    assert m.meta["documents"]["train"] + m.meta["documents"]["eval"] == 10


def test_a_multi_frame_zstd_file_is_split_by_frames(tmp_path, monkeypatch):
    """Frames cut lines anywhere (mid-line, mid-character, on a line end); each line is read once, in order."""
    docs = [*DOCS[:30], "café 東京 " * 40, *DOCS[30:]]
    data = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode()
    cuts = sorted({*range(0, len(data), 997), data.index(b"\n", 5000) + 1, data.index(b"\n", 9000) + 1, len(data)})
    path = tmp_path / "z" / "c.jsonl.zst"
    path.parent.mkdir()
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(data[a:b]) for a, b in itertools.pairwise(cuts)))
    ref = prepare(jsonl(tmp_path / "j" / "c.jsonl", docs), tmp_path / "ref", **KW)
    monkeypatch.setattr(sources, "UNIT_BYTES", 2500)
    units = plan_units([path])
    assert len(units) > 5 and units[0].start == 0 and units[-1].stop == len(cuts) - 1
    assert [d for u in units for d in iter_unit(u)] == docs
    split = prepare(path, tmp_path / "n1", **KW).meta["documents"]  # each task holds out its own eval share
    assert sum(split.values()) == sum(ref.meta["documents"].values()) and split["eval"] > 0
    same_for_any_parts(path, tmp_path, tmp_path / "n1")


def test_a_zstd_task_after_an_empty_frame_keeps_its_first_line(tmp_path, monkeypatch):
    """An empty frame (concatenated zstd outputs, one of an empty file) before a task's first frame says nothing
    about where the line before ends: the task still reads the line it starts with."""
    first, second = (json.dumps({"text": d}) + "\n" for d in DOCS[:2])
    compress = zstandard.ZstdCompressor().compress
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(compress(first.encode()) + compress(b"") + compress(second.encode()))
    monkeypatch.setattr(sources, "UNIT_BYTES", len(first) + 1)  # tasks: frames 0-1 and frame 2
    units = plan_units([path])
    assert [(u.start, u.stop) for u in units] == [(0, 2), (2, 3)]
    assert [d for u in units for d in iter_unit(u)] == DOCS[:2]


def test_zstd_and_gzip_by_content(tmp_path):
    data = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    prepare(jsonl(tmp_path / "j" / "c.jsonl", DOCS), tmp_path / "ref", **KW)
    for name, path in {"zst": zst(tmp_path / "z" / "c.jsonl.zst", data),
                       "zst-no-suffix": zst(tmp_path / "z2" / "c.jsonl", data),
                       "gz-no-suffix": tmp_path / "g" / "c.jsonl"}.items():
        if name == "gz-no-suffix":
            path.parent.mkdir()
            path.write_bytes(gzip.compress(data))
        prepare(path, tmp_path / name, **KW)
        assert same_shards(tmp_path / name, tmp_path / "ref"), name


def test_datasets_folder_reads_its_arrow_files_in_its_own_order(tmp_path):
    folder = hf_folder(tmp_path / "ds", [DOCS[30:], DOCS[:30]], ["data-00001-of-00002.arrow",
                                                                "data-00000-of-00002.arrow"])
    files = resolve_inputs(folder)
    assert [f.name for f in files] == ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]
    assert [d for u in plan_units(files) for d in iter_unit(u)] == DOCS[30:] + DOCS[:30]
    # the same documents in the same files as JSONL give the same shards
    ref = tmp_path / "j"
    jsonl(ref / "a.jsonl", DOCS[30:])
    jsonl(ref / "b.jsonl", DOCS[:30])
    prepare(ref, tmp_path / "ref", **KW)
    prepare(folder, tmp_path / "o", **KW)
    assert same_shards(tmp_path / "o", tmp_path / "ref")
    # an Arrow IPC *file* (not stream) is read too
    table = pa.table({"text": DOCS[:4]})
    with pa.OSFile(str(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert list(iter_unit(plan_units([tmp_path / "f.arrow"])[0])) == DOCS[:4]


def test_a_folder_mixing_formats(tmp_path):
    mixed = tmp_path / "mixed"
    jsonl(mixed / "a.jsonl", DOCS[:10])
    parquet(mixed / "b.parquet", DOCS[10:20])
    zst(mixed / "c.jsonl.zst", "".join(json.dumps({"text": d}) + "\n" for d in DOCS[20:30]).encode())
    (mixed / "d.txt.gz").write_bytes(gzip.compress(DOCS[30].encode()))
    hf_folder(mixed / "e", [DOCS[31:40]], ["data-00000-of-00001.arrow"])
    megatron(mixed / "f", [tokenizer().encode(d) for d in DOCS[40:45]], np.uint16)
    units = plan_units(resolve_inputs(mixed))
    assert [u.format for u in units] == ["jsonl", "parquet", "jsonl", "text", "arrow", "megatron"]
    m = prepare(mixed, tmp_path / "o", **KW)
    assert m.meta["documents"]["train"] + m.meta["documents"]["eval"] == 45


# --- pre-tokenized inputs ---------------------------------------------------------------------------------------

def megatron(prefix: Path, docs: list[list[int]], dtype, eod: int | None = None, split_in: int = 1) -> Path:
    """A Megatron indexed dataset written by megatron-core's own IndexedDatasetBuilder (optionally with an EOD
    appended to every document, as preprocess_data.py --append-eod does, and documents of several sequences)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in docs:
        ids = list(doc) + ([eod] if eod is not None else [])
        cut = [len(ids) * k // split_in for k in range(split_in + 1)]
        builder.add_document(torch.tensor(ids), [b - a for a, b in itertools.pairwise(cut)])
    builder.finalize(str(prefix) + ".idx")
    return prefix


def token_docs(n: int = 40) -> list[list[int]]:
    tok = tokenizer()
    return [tok.encode(d) for d in DOCS[:n]]


def one_record(tmp_path: Path, inputs, docs: list[list[int]], **kw) -> list[list[int]]:
    """Prepare into a single record holding every document (no ragged tail dropped); its documents, sorted."""
    eos = tokenizer().eos_id
    total = sum(len(d) + 1 for d in docs)
    out = tmp_path / "one"
    prepare(inputs, out, **{**KW, "record_len": total, "eval_fraction": 0, "shard_records": 1, **kw})
    stream = all_records(out).tolist()
    assert len(stream) == total and stream[-1] == eos
    got, cur = [], []
    for t in stream:
        if t == eos:
            got.append(cur)
            cur = []
        else:
            cur.append(t)
    return sorted(got)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float32, np.float64,
                                   np.uint16])
def test_megatron_every_dtype_reads_exactly_the_documents(tmp_path, dtype):
    limit = 127 if dtype in (np.uint8, np.int8) else 4096
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, limit, size=int(rng.integers(1, 50))).tolist() for _ in range(30)]
    prefix = megatron(tmp_path / "ds", docs, dtype, split_in=2)
    units = plan_units(resolve_inputs(str(prefix)))  # the prefix, as Megatron's --data-path names it
    assert [u.format for u in units] == ["megatron"] and MegatronIndex(Path(units[0].path)).dtype == np.dtype(dtype)
    got = [d.tolist() for u in units for d in iter_unit(u, eos_id=-1)]
    assert got == docs


def test_megatron_import_keeps_ids_documents_and_parts(tmp_path, monkeypatch):
    docs = token_docs()
    eos = tokenizer().eos_id
    prefix = megatron(tmp_path / "mt" / "kjv_text_document", docs, np.int32, eod=eos)  # --append-eod
    assert one_record(tmp_path, str(prefix), docs) == sorted(docs)  # the EOD is not doubled
    # a large dataset is several map tasks (document ranges); parts give the same bytes
    monkeypatch.setattr(sources, "UNIT_BYTES", 4 * sum(map(len, docs)) // 5)  # int32: about 5 tasks
    units = plan_units([prefix.with_suffix(".idx")])
    assert len(units) >= 4 and units[0].start == 0 and units[-1].stop == len(docs)
    assert all(a.stop == b.start for a, b in itertools.pairwise(units))
    whole = prepare(prefix.with_suffix(".bin"), tmp_path / "n1", **KW)  # the .bin names the dataset too
    assert whole.meta["documents"]["train"] + whole.meta["documents"]["eval"] == len(docs)
    out = tmp_path / "n3"
    for stage in ("map", "reduce"):
        for i in range(3):
            prepare(prefix.with_suffix(".idx"), out, part=(i, 3), stage=stage, **KW)
    prepare(prefix.with_suffix(".idx"), out, part=(0, 3), stage="merge", **KW)
    assert folder_bytes(out) == folder_bytes(tmp_path / "n1")
    prepare(prefix, tmp_path / "p2", num_proc=2, **KW)  # map tasks in worker processes
    assert folder_bytes(tmp_path / "p2") == folder_bytes(tmp_path / "n1")


def test_flat_bin_and_npy_split_at_eos(tmp_path):
    docs = token_docs(30)
    eos = tokenizer().eos_id
    flat = np.array([t for d in docs for t in [*d, eos]], dtype=np.uint16)  # nanoGPT's train.bin
    flat.tofile(tmp_path / "train.bin")
    assert one_record(tmp_path / "a", tmp_path / "train.bin", docs) == sorted(docs)
    np.save(tmp_path / "tokens.npy", flat.astype(np.uint32))
    assert one_record(tmp_path / "b", tmp_path / "tokens.npy", docs) == sorted(docs)
    flat.astype(np.uint32).tofile(tmp_path / "wide.bin")  # uint32 without a header: named by --token-dtype
    assert one_record(tmp_path / "c", tmp_path / "wide.bin", docs, token_dtype="uint32") == sorted(docs)
    np.array([10, 11, 12, eos, 7, 5000, eos], dtype=np.uint16).tofile(tmp_path / "big.bin")
    with pytest.raises(CorpusError, match=r"big.bin: document 1 \(EOS-separated\) holds token id 5000 \(its token "
                                          r"1\), but tokenizer .* has 4096 tokens.*--token-dtype"):
        prepare(tmp_path / "big.bin", tmp_path / "d", **KW)
    with pytest.raises(CorpusError, match=r"big.bin: 14 bytes is not a whole number of uint32 tokens"):
        prepare(tmp_path / "big.bin", tmp_path / "d", **{**KW, "token_dtype": "uint32"})
    with pytest.raises(ValueError, match="tokenizer they come from"):
        prepare(tmp_path / "train.bin", tmp_path / "e", **{**KW, "tokenizer": "train"})


def test_mixture_over_an_imported_megatron_source(tmp_path):
    """An imported Megatron dataset is ordinary prepared shards: mixed with a text source, with exact resume and
    per-source counts."""
    prefix = megatron(tmp_path / "mt" / "ds", token_docs(60), np.uint16)
    prepare(prefix, tmp_path / "mt-shards", tokenizer="bundled:kjv-bpe-4k", record_len=33, shard_records=16,
            eval_fraction=0.1, seed=1, progress=False)
    text = shards(tmp_path, "text")
    cfg = config("", f'data.sources=[{{shards="{text}", weight=0.5, name="text"}}, '
                     f'{{shards="{tmp_path / "mt-shards"}", weight=0.5, name="megatron"}}]')
    ref = build_loader(cfg, tokenizer(), "train", 0, 1, with_sample_ids=True)
    batches = [next(ref) for _ in range(6)]
    src = torch.cat([b["source_ids"] for b in batches])
    assert (src == 1).sum() == (src == 0).sum() == 12
    scalars = ref.source_scalars()
    assert scalars["data/megatron/samples"] == 12 and scalars["data/megatron/tokens"] == 12 * 32
    first = build_loader(cfg, tokenizer(), "train", 0, 1, with_sample_ids=True)
    for _ in range(3):
        next(first)
    resumed = build_loader(cfg, tokenizer(), "train", 0, 1, with_sample_ids=True)
    resumed.load_state_dict(first.state_dict())
    for want in batches[3:]:
        got = next(resumed)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["source_ids"], want["source_ids"])


# --- tokenizers people have -------------------------------------------------------------------------------------

def test_hugging_face_tokenizer_folder(tmp_path):
    """A model's folder names its own special tokens in tokenizer_config.json (Llama 3: <|begin_of_text|>,
    <|end_of_text|>), which no common name matches; prepare keeps them with the tokenizer it writes."""
    from tokenizers import AddedToken

    hf = load_tokenizer("bundled:kjv-bpe-4k").hf
    hf.add_special_tokens([AddedToken("<|begin_of_text|>", special=True), AddedToken("<|end_of_text|>",
                                                                                     special=True)])
    folder = tmp_path / "llama-like"
    folder.mkdir()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>", "special": True},
        "pad_token": None}))
    tok = load_tokenizer(str(folder))
    assert (tok.bos_id, tok.eos_id) == (hf.token_to_id("<|begin_of_text|>"), hf.token_to_id("<|end_of_text|>"))
    assert tok.pad_id == load_tokenizer("bundled:kjv-bpe-4k").pad_id  # no pad in the config: the name found
    m = prepare(jsonl(tmp_path / "c.jsonl", DOCS[:20]), tmp_path / "o", **{**KW, "tokenizer": str(folder)})
    assert m.tokenizer["eos_id"] == tok.eos_id
    again = load_tokenizer(str(tmp_path / "o" / "tokenizer.json"))
    assert (again.eos_id, again.bos_id, again.sha256) == (tok.eos_id, tok.bos_id, tok.sha256)
    assert tok.eos_id in all_records(tmp_path / "o").tolist()  # documents are packed with that EOS
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|begin_of_text|>"}))
    assert load_tokenizer(str(folder)).sha256 != tok.sha256  # another EOS between documents: another tokenizer
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=r"names eos_token '<\|eot_id\|>', which is not in its tokenizer.json"):
        load_tokenizer(str(folder))


# --- bad data: clear, and the finished work kept ----------------------------------------------------------------

def test_a_corrupt_file_stops_prepare_and_the_fixed_rerun_keeps_finished_map_tasks(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    data = [("".join(json.dumps({"text": d}) + "\n" for d in DOCS[k::3] * 12)).encode() for k in range(3)]
    assert len(data[1]) > 4 * 65536  # the first frame holds the head checked before any work
    zst(corpus / "a.jsonl.zst", data[0])
    good_b = zst(corpus / "b.jsonl.zst", data[1], frames=4).read_bytes()
    (corpus / "b.jsonl.zst").write_bytes(good_b[:-10])  # truncated inside its last frame
    zst(corpus / "c.jsonl.zst", data[2])
    with pytest.raises(CorpusError, match=r"b.jsonl.zst: cannot be read: the file ends inside a zstd frame "
                                          r"\(truncated\?\) near compressed byte offset \d+.*repair or remove"):
        prepare(corpus, tmp_path / "o", **KW)
    done = sorted(p.name for p in (tmp_path / "o.work" / "map").glob("*.done.json"))
    assert done == ["u000000.done.json"]  # a was finished before b failed
    (corpus / "b.jsonl.zst").write_bytes(good_b)  # the fix
    ran: list[int] = []
    real = prepare_stages.map_unit

    def counting(plan, work, tok, u):
        ran.append(u)
        return real(plan, work, tok, u)

    monkeypatch.setattr(sys.modules["meshformer.data.prepare"], "map_unit", counting)
    prepare(corpus, tmp_path / "o", **KW)
    assert ran == [1, 2]  # a is not tokenized again
    monkeypatch.undo()
    prepare(corpus, tmp_path / "clean", **KW)
    assert folder_bytes(tmp_path / "o") == folder_bytes(tmp_path / "clean")


def test_bad_data_names_the_file_and_position(tmp_path):
    docs = token_docs(10)
    prefix = megatron(tmp_path / "mt" / "ds", docs, np.uint16)
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    bin_.write_bytes(bin_.read_bytes()[:-6])
    with pytest.raises(CorpusError, match=r"ds.idx does not match ds.bin: the index covers \d+ bytes but the .bin "
                                          r"holds \d+ \(byte offset \d+\)"):
        plan_units([idx])
    big = megatron(tmp_path / "mt2" / "ds", [*docs[:3], [5, 4096, 7], *docs[3:]], np.uint16)
    with pytest.raises(CorpusError, match=r"ds.idx: document 3 holds token id 4096 \(its token 1\)"):
        prepare(big, tmp_path / "o", **KW)
    pq_file = tmp_path / "bad.parquet"
    good = parquet(tmp_path / "good.parquet", DOCS[:30]).read_bytes()
    pq_file.write_bytes(good[:100] + b"\0" * 64 + good[164:])  # a data page of row group 0 overwritten
    with pytest.raises(CorpusError, match=r"bad.parquet: unreadable Parquet in row group 0"):
        list(iter_unit(Unit(str(pq_file), "parquet", 0, 1)))
    (tmp_path / "trunc.parquet").write_bytes(good[:len(good) // 2])
    with pytest.raises(CorpusError, match=r"trunc.parquet: unreadable Parquet .*repair or remove"):
        prepare(tmp_path / "trunc.parquet", tmp_path / "o2", **KW)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(json.dumps({"text": d}).encode() + b"\n" for d in DOCS))[:-20])
    with pytest.raises(CorpusError, match=r"t.jsonl.gz: cannot be read \(.*end-of-stream.*\) after \d+ bytes"):
        prepare(gz, tmp_path / "o3", **KW)
    garbage = tmp_path / "g.jsonl.zst"
    garbage.write_bytes(b"\x28\xb5\x2f\xfd" + b"\xff" * 200)
    with pytest.raises(CorpusError, match=r"g.jsonl.zst: cannot be read: corrupt zstd data .* byte offset 0"):
        prepare(garbage, tmp_path / "o4", **KW)


# --- where the same reader is used: zero setup, submit-prepare; the optional extra ------------------------------

def test_zero_setup_prepares_a_parquet_corpus(tmp_path):
    path = parquet(tmp_path / "c" / "corpus.parquet", DOCS)
    cfg = config("", f"data.corpus={path}", f"data.cache_dir={tmp_path / 'cache'}")
    loader = build_loader(cfg, tokenizer(), "train", 0, 1)
    assert next(loader)["input_ids"].shape == (4, 32)
    ref = prepare(jsonl(tmp_path / "j" / "corpus.jsonl", DOCS), tmp_path / "ref", tokenizer="bundled:kjv-bpe-4k",
                  record_len=33, eval_fraction=cfg.data.eval_fraction, seed=cfg.data.seed, progress=False)
    assert loader.manifest.meta["documents"] == ref.meta["documents"]


def test_submit_prepare_forwards_the_new_options(tmp_path, capsys):
    from meshformer.cli import main

    parquet(tmp_path / "c" / "a.parquet", DOCS[:5])
    main(["data", "submit-prepare", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--parts", "2", "--dry-run",
          "--tokenizer", "bundled:kjv-bpe-4k", "--text-field", "body", "--token-dtype", "uint32"])
    scripts = capsys.readouterr().out.split("#!/bin/bash")[1:]
    assert len(scripts) == 3 and all("--text-field body" in s and "--token-dtype uint32" in s for s in scripts)
    assert all(" -P -m meshformer.cli data prepare" in s for s in scripts)  # the job's folder shadows no module


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    from meshformer.cli import main

    path = parquet(tmp_path / "a.parquet", DOCS[:5])
    for name in ("pyarrow", "pyarrow.parquet"):  # None in sys.modules: `import` raises ImportError, as if missing
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", str(path), "--out", str(tmp_path / "o"), "--tokenizer", "bundled:kjv-bpe-4k"])
    assert info.value.code == ("error: reading this input needs the Python package 'pyarrow', which is not installed "
                               "— install the data extra: pip install 'meshformer[data]'")


@pytest.mark.parametrize("encoding", ["dictionary", "large_string", "string_view"])
@pytest.mark.parametrize("container", ["parquet", "arrow"])
def test_text_columns_in_every_string_encoding_are_read(tmp_path, encoding, container):
    """pandas writes categoricals as dictionaries, Polars writes string_view (and large_string): the same text."""
    column = pa.array(DOCS[:12])
    column = column.dictionary_encode() if encoding == "dictionary" else column.cast(getattr(pa, encoding)())
    table = pa.table({"text": column})
    path = tmp_path / f"c.{container}"
    if container == "parquet":
        pq.write_table(table, path, row_group_size=5)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=5)
    assert [d for u in plan_units([path]) for d in iter_unit(u)] == DOCS[:12]
    m = prepare(path, tmp_path / "o", **KW)
    assert m.meta["documents"]["train"] + m.meta["documents"]["eval"] == 12


@pytest.mark.parametrize("nested, words", [([[d] for d in DOCS[:6]], "join each row's strings"),
                                           ([{"body": d} for d in DOCS[:6]], "take the text field (of ['body'])")])
@pytest.mark.parametrize("container", ["parquet", "arrow"])
def test_a_nested_text_column_is_named_with_its_type_before_any_work(tmp_path, nested, words, container):
    table = pa.table({"text": pa.array(nested)})
    path = tmp_path / f"c.{container}"
    if container == "parquet":
        pq.write_table(table, path)
    else:
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    with pytest.raises(CorpusError) as info:
        prepare(path, tmp_path / "o", **KW)
    line = info.value.one_line()
    assert f"c.{container}: column 'text' is nested (" in line and words in line and "text-field" in line, line
    assert not (tmp_path / "o").exists()
