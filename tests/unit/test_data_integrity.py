"""Corrupt, truncated, missing shards and manifest mismatches: always loud, never silently short."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
import webdataset as wds
from helpers.data import config, copy_shards, shards, tokenizer

from meshformer.data import ManifestError, ShardError, build_loader, read_manifest
from meshformer.data.shards import open_url, read_shard


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return shards(tmp_path_factory.mktemp("integrity"))


@pytest.fixture
def data(clean, tmp_path):
    return copy_shards(clean, tmp_path / "shards")


def truncate(path, keep: float = 0.6) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:int(len(raw) * keep) // 512 * 512])  # cut at a tar block boundary: wds reads it "fine"


def garble(path) -> None:
    size = path.stat().st_size
    path.write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())


def test_webdataset_alone_is_silently_short(data):
    # the trap this module guards against: a truncated shard just yields fewer samples
    shard = data / "train-000002.tar"
    truncate(shard)
    n = sum(1 for _ in wds.WebDataset(str(shard), shardshuffle=False))
    assert 0 < n < 41


def test_truncated_shard_raises_naming_it(data):
    truncate(data / "train-000002.tar")
    with pytest.raises(ShardError, match=r"train-000002\.tar.*truncated"):
        build_loader(config(data), tokenizer(), "train", 0, 1)
    # streaming readers (URLs, where no size check is possible) catch it too
    manifest = read_manifest(str(data))
    info = manifest.splits["train"][2]
    with pytest.raises(ShardError, match=r"train-000002\.tar.*(samples read|corrupt)"):
        read_shard(f"pipe:cat {data / info.name}", info, manifest.dtype, None)


def test_garbage_shard_raises_when_streamed(data):
    garble(data / "train-000004.tar")  # same size, so only the content check can tell
    loader = build_loader(config(data), tokenizer(), "train", 0, 1)
    with pytest.raises(ShardError, match=r"train-000004\.tar"):
        for _ in range(200):
            next(loader)


def test_missing_shard_raises_naming_it(data):
    (data / "train-000001.tar").unlink()
    with pytest.raises(ShardError, match=r"train-000001\.tar.*missing"):
        build_loader(config(data), tokenizer(), "train", 0, 1)


def test_skip_mode_drops_bad_shards_and_logs(data, caplog):
    truncate(data / "train-000002.tar")
    garble(data / "train-000004.tar")
    (data / "train-000001.tar").unlink()
    with caplog.at_level(logging.WARNING, logger="meshformer.data"):
        loaders = [build_loader(config(data, 'data.bad_shards="skip"', "data.num_workers=1"), tokenizer(), "train",
                                r, 2, with_sample_ids=True) for r in range(2)]
    assert loaders[0].skipped_shards == ["train-000001.tar", "train-000002.tar", "train-000004.tar"]
    assert "skipping 3 bad shard(s)" in caplog.text and "123 samples lost" in caplog.text
    n = loaders[0].samples_per_epoch
    assert n == 264 - 3 * 41
    steps = math.ceil(n / 8)
    ids = [i for _ in range(steps) for loader in loaders for i in next(loader)["sample_ids"].tolist()][:n]
    good = [i for i in range(264) if i // 41 not in (1, 2, 4)]
    assert sorted(ids) == good  # every remaining sample exactly once, ranks still in step


def test_manifest_count_mismatch(data):
    path = data / "manifest.json"
    tree = json.loads(path.read_text())
    tree["splits"]["train"]["shards"][3]["samples"] = 40
    path.write_text(json.dumps(tree))
    loader = build_loader(config(data), tokenizer(), "train", 0, 1)
    with pytest.raises(ShardError, match=r"train-000003\.tar does not match the manifest: 41 samples read, "
                                         r"manifest says 40"):
        for _ in range(200):
            next(loader)


def test_manifest_tokenizer_mismatch(data, tmp_path):
    other = tokenizer().json.replace('"<extra_id_31>"', '"<extra_id_x>"')
    (tmp_path / "other.json").write_text(other)
    from meshformer.data import load_tokenizer

    with pytest.raises(ManifestError, match="prepared with tokenizer"):
        build_loader(config(data), load_tokenizer(str(tmp_path / "other.json")), "train", 0, 1)


def test_manifest_too_short_records_and_bad_version(data):
    with pytest.raises(ManifestError, match=r"33-token records.*needs 65.*--record-len 65"):
        build_loader(config(data, "data.seq_len=64"), tokenizer(), "train", 0, 1)
    path = data / "manifest.json"
    path.write_text(path.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ManifestError, match="version 99"):
        build_loader(config(data), tokenizer(), "train", 0, 1)
    path.unlink()
    with pytest.raises(ManifestError, match=r"no manifest.*data prepare"):
        build_loader(config(data), tokenizer(), "train", 0, 1)


def test_reads_from_urls(data):
    """Shards stream through pipes and fsspec URLs with the same verification."""
    import fsspec

    manifest = read_manifest(str(data / "manifest.json"))
    info = manifest.splits["train"][0]
    local = read_shard(str(data / info.name), info, manifest.dtype, None)
    via_pipe = read_shard(f"pipe:cat {data / info.name}", info, manifest.dtype, None)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/mf/{info.name}", (data / info.name).read_bytes())
    via_fsspec = read_shard(f"memory://mf/{info.name}", info, manifest.dtype, {0, 5})
    assert len(local) == 41 and sorted(via_fsspec) == [0, 5]
    assert all(np.array_equal(local[i]["tokens"], via_pipe[i]["tokens"]) for i in local)
    assert np.array_equal(local[5]["tokens"], via_fsspec[5]["tokens"])
    with open_url(str(data / info.name)) as fh:
        assert fh.read(5)


def test_loader_streams_from_an_object_store_url(clean):
    """A whole loader from fsspec URLs (memory:// stands in for s3:// or gs://), same samples as local."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in clean.iterdir():
        fs.pipe(f"/store/{path.name}", path.read_bytes())
    remote = build_loader(config("memory://store/manifest.json"), tokenizer(), "train", 1, 2, with_sample_ids=True)
    local = build_loader(config(clean), tokenizer(), "train", 1, 2, with_sample_ids=True)
    for _ in range(5):
        a, b = next(remote), next(local)
        assert torch.equal(a["sample_ids"], b["sample_ids"]) and torch.equal(a["input_ids"], b["input_ids"])
    fs.pipe("/store/train-000000.tar", b"\0" * 512)  # the store serves a broken object: still caught
    broken = build_loader(config("memory://store/manifest.json"), tokenizer(), "train", 0, 1)
    with pytest.raises(ShardError, match=r"memory://store/train-000000\.tar"):
        for _ in range(100):
            next(broken)


def test_bad_shard_read_closes_its_stream_and_pipe(data, monkeypatch):
    """The error path closes what it opened: no leaked file handle or `pipe:` child per bad shard."""
    import meshformer.data.shards as shards_mod

    garble(data / "train-000004.tar")
    manifest = read_manifest(str(data))
    info = manifest.splits["train"][4]
    opened = []

    def recording_open(url):
        opened.append(open_url(url))
        return opened[-1]

    monkeypatch.setattr(shards_mod, "open_url", recording_open)
    with pytest.raises(ShardError, match=r"train-000004\.tar"):
        read_shard(f"pipe:cat {data / info.name}", info, manifest.dtype, None)
    (pipe,) = opened
    assert pipe.stream.closed
    assert pipe.proc.returncode is not None  # the child was waited for (no zombie, no open pipe)


def test_bad_shard_sets_are_united_across_ranks():
    from meshformer.data.build import agree_on_bad_shards, union_bad_shards

    merged = union_bad_shards([{"b.tar": "missing"}, {}, {"a.tar": "corrupt", "b.tar": "truncated"}])
    assert list(merged) == ["a.tar", "b.tar"]
    assert merged["b.tar"] == "missing" and "rank 2" in merged["a.tar"]
    assert union_bad_shards([{}, {}]) == {}
    problems = {"x.tar": "missing"}
    assert agree_on_bad_shards(problems) is problems  # one process: unchanged, no collective
