"""A prepared dataset is data (#24): its tar members are checked by type and name as they are read, and its
manifest may name shards outside its folder (paths, URLs, `pipe:` commands) only when the user's config says so."""

from __future__ import annotations

import json
import shutil
import tarfile

import numpy as np
import pytest
from helpers.data import config, copy_shards, forge_shard, shards, tar_member, tokenizer

from meshformer.data import ShardError, build_loader, read_manifest
from meshformer.data.build import check_data
from meshformer.data.shards import read_shard, read_shard_records
from meshformer.folders import UnsafePathError

GOOD = ["000000001.tokens.u16", "000000002.tokens.u16", "000000003.tokens.u16"]  # records 1-3 of a forged shard


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return shards(tmp_path_factory.mktemp("untrusted"))


@pytest.fixture
def data(clean, tmp_path):
    return copy_shards(clean, tmp_path / "shards")


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
            read_shard_records(url, info, manifest.dtype, np.array([0]), kind=manifest.kind)
        else:
            read_shard(url, info, manifest.dtype, None, kind=manifest.kind)
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
        got = read_shard(manifest.shard_url(info), info, manifest.dtype, None, kind=kind)
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
