"""Corrupt, truncated, missing shards and manifest mismatches: always loud, never silently short. And a prepared
dataset is data (#24): its tar members are checked by type and name as they are read, and its manifest may name
shards outside its folder (paths, URLs, `pipe:` commands) only when the user's config says so."""

from __future__ import annotations

import json
import logging
import math
import shutil
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from helpers.data import config, copy_shards, forge_shard, shards, tar_member, tokenizer

from meshformer.data import ManifestError, ShardError, build_loader, read_manifest
from meshformer.data.build import check_data
from meshformer.data.shards import open_url, read_shard, read_shard_records
from meshformer.folders import UnsafePathError


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


# ----------------------------------------------------------------------------- crafted shards (#24)


GOOD = ["000000001.tokens.u16", "000000002.tokens.u16", "000000003.tokens.u16"]  # records 1-3 of a forged shard


# (first record's members, words the error must hold)
MEMBERS = {
    "dotdot": (["../000000000.tokens.u16"], ["'../000000000.tokens.u16'", "outside the shard"]),
    "absolute": (["/tmp/000000000.tokens.u16"], ["'/tmp/000000000.tokens.u16'", "outside the shard"]),
    "symlink": ([tar_member("000000000.tokens.u16", tarfile.SYMTYPE, "/etc/passwd")], ["is a symbolic link"]),
    "hardlink": ([tar_member("000000000.tokens.u16", tarfile.LNKTYPE, "../../x")], ["is a hard link"]),
    "device": ([tar_member("000000000.tokens.u16", tarfile.CHRTYPE)], ["is a device or pipe"]),
    "fifo": ([tar_member("000000000.tokens.u16", tarfile.FIFOTYPE)], ["is a device or pipe"]),
    "folder": ([tar_member("000000000.tokens.u16", tarfile.DIRTYPE)], ["is a folder"]),
    "extra-key": (["000000000.tokens.u16", "000000000.cmd.u16"], ["record 000000000 holds the keys ['cmd', 'tokens']",
                                                                   "['tokens']"]),
    "missing-key": (["000000000.src.u16"], ["record 000000000 holds the keys ['src']"]),
    "other-name": (["000000000.tokens.npy"], ["'000000000.tokens.npy' is not named <record>.<key>.u16"]),
    "wrong-dtype": (["000000000.tokens.u32"], ["is not named <record>.<key>.u16"]),
    "out-of-order": (["000000005.tokens.u16"], ["'000000005.tokens.u16' found where record 000000000 belongs"]),
}


@pytest.mark.parametrize("ranged", [False, True], ids=["streamed", "ranged"])
@pytest.mark.parametrize("case", list(MEMBERS))
def test_every_tar_member_is_checked_by_type_and_name(data, case, ranged):
    first, words = MEMBERS[case]
    name = forge_shard(data, [first, *([m] for m in GOOD)])
    manifest = read_manifest(str(data))
    info = manifest.splits["train"][0]
    url = manifest.shard_url(info)
    with pytest.raises(ShardError) as caught:
        if ranged:  # one record of four: read by its index entry (whose digest the forger made match)
            read_shard_records(url, info, manifest.dtype, np.array([0]), record_type=manifest.record_type)
        else:
            read_shard(url, info, manifest.dtype, None, record_type=manifest.record_type)
    line = caught.value.one_line()
    assert line.startswith(f"shard {data / name}: member") or f"shard {data / name}: record" in line, line
    for word in (*words, "re-run `meshformer data prepare`"):
        assert word in line, (word, line)


def test_the_loader_fails_in_one_line_not_a_key_error(data):
    """The issue's case: a member named `../...` made the loader look up a key that was not there."""
    forge_shard(data, [["../000000000.tokens.u16"], *([m] for m in GOOD)])
    cfg = config(data, "data.shuffle_shards=1", "data.bad_shards=skip")  # skip: every shard hashed up front
    with pytest.raises(ShardError, match=r"'\.\./000000000\.tokens\.u16' names a path outside the shard"):
        next(iter(build_loader(config(data), tokenizer(), "train", 0, 1)))
    loader = build_loader(cfg, tokenizer(), "train", 0, 1)  # data.bad_shards='skip' leaves the shard out, logged
    assert any("train-000000.tar" in name for name in loader.skipped_shards) and next(iter(loader))["input_ids"].shape


def test_well_formed_shards_of_both_kinds_still_read(data, tmp_path):
    from meshformer.data import prepare

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"src": f"seed {i}", "tgt": f"grain {i}"}) + "\n" for i in range(20)))
    for folder, kind in ((data, "packed"), (prepare(pairs, tmp_path / "p", tokenizer="bundled:kjv-bpe-4k",
                                                    pairs=True, progress=False).url, "pairs")):
        manifest = read_manifest(str(folder))
        info = manifest.splits["train"][0]
        got = read_shard(manifest.shard_url(info), info, manifest.dtype, None, record_type=kind)
        assert len(got) == info.samples and all(sorted(r) == sorted(("tokens",) if kind == "packed" else
                                                                    ("src", "tgt")) for r in got.values())


# ----------------------------------------------------------------------------- only the user's config opts in


def _moved_out(data, tmp_path, rename) -> str:
    """Move train shard 0 (and its index) out of the dataset folder; the manifest names it by `rename(path)`."""
    tree = json.loads((data / "manifest.json").read_text())
    entry = tree["splits"]["train"]["shards"][0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in (entry["name"], entry["name"][:-4] + ".idx"):
        shutil.move(data / name, elsewhere / name)
    entry["name"] = rename(elsewhere / entry["name"])
    (data / "manifest.json").write_text(json.dumps(tree))
    return entry["name"]


@pytest.mark.parametrize("rename", [str, lambda path: f"pipe:cat {path}"], ids=["absolute", "pipe"])
def test_a_manifest_names_shards_elsewhere_only_when_the_config_allows(data, clean, tmp_path, rename):
    named = _moved_out(data, tmp_path, rename)
    with pytest.raises(UnsafePathError, match="data.allow_remote_shards=true"):
        build_loader(config(data), tokenizer(), "train", 0, 1)
    loader = build_loader(config(data, "data.allow_remote_shards=true", "data.shuffle_shards=7"), tokenizer(),
                          "train", 0, 1)
    assert loader.manifest.shard_url(loader.manifest.splits["train"][0]) == named
    reference = build_loader(config(clean, "data.shuffle_shards=7"), tokenizer(), "train", 0, 1)
    for _ in range(3):  # the same samples as from the dataset before the shard moved
        assert np.array_equal(next(loader)["input_ids"], next(reference)["input_ids"])


def test_the_manifest_cannot_opt_itself_in(data, tmp_path):
    _moved_out(data, tmp_path, str)
    tree = json.loads((data / "manifest.json").read_text())
    tree["allow_remote_shards"] = True
    tree["meta"]["allow_remote_shards"] = True
    (data / "manifest.json").write_text(json.dumps(tree))
    with pytest.raises(UnsafePathError, match="which is not a file inside its folder"):
        read_manifest(str(data))


def test_each_mixture_source_opts_in_on_its_own(data, clean, tmp_path):
    _moved_out(data, tmp_path, str)
    trusted = f'{{shards="{data}", allow_remote_shards=true}}'
    cfg = config(data, f'data.sources=[{trusted}, {{shards="{clean}"}}]', 'data.shards=""')
    check_data(cfg, tokenizer())
    cfg = config(data, f'data.sources=[{{shards="{clean}", allow_remote_shards=true}}, {{shards="{data}"}}]',
                 'data.shards=""')
    with pytest.raises(UnsafePathError, match=f"the manifest {data / 'manifest.json'} names"):
        check_data(cfg, tokenizer())


@pytest.mark.parametrize("name", ["train-000001.tar", "train-000001.idx"])
def test_a_shard_or_index_linked_out_of_the_folder_is_refused(data, tmp_path, name):
    """A link inside the dataset to a file elsewhere: the shard, or the index a ranged read would trust."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(data / name, elsewhere / name)
    (data / name).symlink_to(elsewhere / name)
    with pytest.raises(UnsafePathError, match=f"names '{name}', which resolves outside"):
        read_manifest(str(data))
    loader = build_loader(config(data, "data.allow_remote_shards=true"), tokenizer(), "train", 0, 1)
    assert next(loader)["input_ids"].shape == (4, 32)  # the user's own config may vouch for it
