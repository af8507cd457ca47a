"""`data prepare`: inputs, packing, manifest, determinism, pairs, CLI, and the zero-setup default."""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os

import numpy as np
import pytest
from helpers.data import config, kjv_docs, small_corpus, tokenizer

from meshformer.config import Config
from meshformer.data import ManifestError, build_loader, prepare, read_manifest
from meshformer.data.cli import add_cli, main
from meshformer.data.shards import read_shard, token_dtype
from meshformer.data.sources import CorpusError


def folder_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_deterministic_and_independent_of_process_count(tmp_path):
    corpus = small_corpus(tmp_path / "c", 8)
    kwargs = dict(tokenizer="train", vocab_size=400, record_len=33, shard_records=50, progress=False)
    a = prepare(corpus, tmp_path / "a", **kwargs)
    prepare(corpus, tmp_path / "b", **kwargs)
    prepare(corpus, tmp_path / "c2", num_proc=2, **kwargs)
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "b") == folder_bytes(tmp_path / "c2")
    assert a.tokenizer["vocab_size"] == 400 and a.dtype == "uint16"
    other = prepare(corpus, tmp_path / "d", seed=2, **kwargs)
    assert other.splits["train"][0].sha256 != a.splits["train"][0].sha256


def test_packing_manifest_and_split(tmp_path):
    docs = kjv_docs(10)
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in docs))
    m = prepare(corpus, tmp_path / "out", tokenizer="bundled:kjv-bpe-4k", record_len=20, text_field="body",
                eval_fraction=0.2, shard_records=30, progress=False)
    tok = tokenizer()
    assert m.meta["documents"] == {"train": 8, "eval": 2}
    assert m.record_len == 20 and m.tokenizer["sha256"] == tok.sha256
    assert (tmp_path / "out" / "tokenizer.json").read_text() == tok.json
    stream = {}
    for split in ("train", "eval"):
        records = []
        for info in m.splits[split]:
            got = read_shard(m.shard_url(info), info, m.dtype, None)
            assert len(got) == info.samples and info.tokens == 20 * info.samples
            records += [got[i]["tokens"] for i in range(info.samples)]
        stream[split] = np.concatenate(records).tolist()
    assert [s.samples for s in m.splits["train"]][:-1] == [30] * (len(m.splits["train"]) - 1)
    # train + eval streams are the documents, each followed by EOS, in shuffled order, ragged tails dropped
    eos = tok.eos_id
    texts = {tok.decode(d) for split in stream.values() for d in _split_on(split, eos)[:-1]}
    assert texts <= set(docs) and len(texts) >= 8
    whole = {tok.decode(d) for d in _split_on(stream["train"], eos)[:-1]}
    held = {tok.decode(d) for d in _split_on(stream["eval"], eos)[:-1]}
    assert not whole & held, "a document is in both splits"
    assert read_manifest(str(tmp_path / "out")).to_json() == (tmp_path / "out" / "manifest.json").read_text()


def _split_on(ids: list[int], sep: int) -> list[list[int]]:
    out, cur = [], []
    for t in ids:
        if t == sep:
            out.append(cur)
            cur = []
        else:
            cur.append(t)
    return [*out, cur]


def test_text_inputs_directories_and_gz(tmp_path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first paragraph\n\nsecond paragraph\n")
    with gzip.open(root / "sub" / "b.rst.gz", "wt") as fh:
        fh.write("gzipped restructured text " * 20)
    (root / "ignored.bin").write_bytes(b"\0\1")
    m = prepare(root, tmp_path / "o1", tokenizer="bundled:kjv-bpe-4k", record_len=8, eval_fraction=0,
                progress=False)
    assert m.meta["documents"] == {"train": 2, "eval": 0} and len(m.meta["inputs"]) == 2
    m2 = prepare(root, tmp_path / "o2", tokenizer="bundled:kjv-bpe-4k", record_len=8, eval_fraction=0,
                 doc_split="paragraph", progress=False)
    assert m2.meta["documents"]["train"] == 3
    with pytest.raises(CorpusError, match="does not exist"):
        prepare(tmp_path / "nope", tmp_path / "o3", progress=False)
    with pytest.raises(CorpusError, match=r"no string field 'text'.*--text-field"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"body": "x"}\n')
        prepare(bad, tmp_path / "o4", tokenizer="bundled:kjv-bpe-4k", progress=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        prepare(root, tmp_path / "o1", tokenizer="bundled:kjv-bpe-4k", progress=False)


def test_token_dtype_follows_vocabulary():
    assert token_dtype(4096) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(70000) == np.uint32


def test_pairs_feed_seq2seq(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"src": f"verse {i} of the book", "tgt": f"the book verse {i}"}) + "\n"
                             for i in range(30)))
    m = prepare(pairs, tmp_path / "p", tokenizer="bundled:kjv-bpe-4k", pairs=True, eval_fraction=0.1,
                progress=False)
    assert m.record_type == "pairs" and m.splits["train"][0].samples == 27
    cfg = config(tmp_path / "p", 'train.objective="seq2seq"', family="encoder_decoder")
    loader = build_loader(cfg, tokenizer(), "train", 0, 1)
    batch = next(loader)
    tok = tokenizer()
    for i in range(4):
        src = tok.decode(batch["input_ids"][i][batch["attention_mask"][i]].tolist())
        tgt = tok.decode(batch["labels"][i][batch["labels"][i] >= 0].tolist())
        n = src.split()[1]
        assert src == f"verse {n} of the book<eos>" and tgt == f"the book verse {n}<eos>"
    with pytest.raises(ManifestError, match=r"pairs.*seq2seq"):
        build_loader(config(tmp_path / "p"), tokenizer(), "train", 0, 1)


def test_cli_prepare(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="meshformer")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "prepare", str(small_corpus(tmp_path, 4)), "--out", str(tmp_path / "o"),
                              "--tokenizer", "bundled:kjv-bpe-4k", "--seq-len", "16", "--quiet"])
    assert args.func(args) == 0
    assert "train with: meshformer train tiny-gpt --set data.shards=" in capsys.readouterr().out
    assert read_manifest(str(tmp_path / "o")).record_len == 17
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "x"), "--quiet"])
    assert exit_info.value.code.startswith("error: corpus input") and "does not exist" in exit_info.value.code


def test_default_config_prepares_bundled_corpus_once(tmp_path, caplog):
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.data.num_workers = 0
    with caplog.at_level(logging.INFO, logger="meshformer.data"):
        loader = build_loader(cfg, tokenizer(), "train", 0, 1)
    assert "preparing them into" in caplog.text
    batch = next(loader)
    assert batch["input_ids"].shape == (16, 128)
    assert loader.samples_per_epoch > 7000  # ~1M tokens of KJV
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshformer.data"):
        evals = build_loader(cfg, tokenizer(), "eval", 0, 1)
    assert "preparing" not in caplog.text and evals.samples_per_epoch > 100


def test_a_resumed_prepare_redoes_a_megatron_unit_whose_data_file_changed(tmp_path):
    """A Megatron unit is named by its .idx, but its tokens live in the .bin: rewriting only the .bin (same size,
    e.g. regenerated ids) must not leave the finished map task of the old tokens in place."""
    from meshformer.data.prepare_stages import unit_fingerprint

    idx, data = tmp_path / "ds.idx", tmp_path / "ds.bin"
    idx.write_bytes(b"index")
    data.write_bytes(b"\x01\x00\x02\x00")
    plan = {"units": [[str(idx), "megatron", -1, -1]]}
    before = unit_fingerprint(plan, 0)
    data.write_bytes(b"\x03\x00\x04\x00")
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert unit_fingerprint(plan, 0) != before


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_shard_writer_writes_webdatasets_bytes(tmp_path, dtype):
    """The shard writer builds tar headers itself (speed); the files stay byte for byte what webdataset's
    TarWriter writes, for packed records and for src/tgt pairs of any lengths (also empty)."""
    import webdataset as wds

    from meshformer.data.shards import ShardWriter, dtype_ext

    rng = np.random.default_rng(0)
    records = [{"tokens": rng.integers(0, 4000, 33)} for _ in range(20)]
    records += [{"tgt": rng.integers(0, 4000, int(rng.integers(0, 40))), "src": rng.integers(0, 4000, 300)}
                for _ in range(20)]
    ours = ShardWriter(tmp_path / "ours.tar", np.dtype(dtype))
    with open(tmp_path / "theirs.tar", "wb") as fh:
        theirs = wds.TarWriter(fh, user="meshformer", group="meshformer", mtime=0, encoder=False)
        for i, record in enumerate(records):
            ours.write(**record)
            theirs.write({"__key__": f"{i:09d}", **{f"{k}.{dtype_ext(np.dtype(dtype))}": v.astype(dtype).tobytes()
                                                    for k, v in record.items()}})
        theirs.close()
    ours.close()
    assert (tmp_path / "ours.tar").read_bytes() == (tmp_path / "theirs.tar").read_bytes()
