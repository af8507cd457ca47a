"""Prepare at scale: the same shards and manifest for any number of parts, memory flat in corpus size."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.data import ROOT_DIR, config, tokenizer, write_corpus

from meshformer.data import build_loader, prepare, read_manifest
from meshformer.data.shards import read_shard
from meshformer.errors import UsageError

KW = dict(tokenizer="bundled:kjv-bpe-4k", record_len=65, shard_records=20, eval_fraction=0.05, seed=3,
          bucket_mb=0.03, progress=False)


def folder_bytes(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), 0.25, files=6)


def prepare_in_parts(corpus, out, n: int):
    for stage in ("map", "reduce"):
        for i in reversed(range(n)):  # any order within a stage
            assert prepare(corpus, out, part=(i, n), stage=stage, **KW) is None
    return prepare(corpus, out, part=(0, n), stage="merge", **KW)


def test_parts_1_2_4_give_identical_shards_and_manifest(corpus, tmp_path):
    whole = prepare(corpus, tmp_path / "n1", **KW)
    assert whole.meta["buckets"]["train"] >= 6 and len(whole.splits["train"]) > whole.meta["buckets"]["train"]
    for n in (2, 4):
        m = prepare_in_parts(corpus, tmp_path / f"n{n}", n)
        assert m.to_json() == whole.to_json()
        assert folder_bytes(tmp_path / f"n{n}") == folder_bytes(tmp_path / "n1")
        assert not (tmp_path / f"n{n}.work").exists()
    procs = prepare(corpus, tmp_path / "p2", num_proc=2, **KW)
    assert procs.to_json() == whole.to_json() and folder_bytes(tmp_path / "p2") == folder_bytes(tmp_path / "n1")
    docs = whole.meta["documents"]
    total = sum(1 for f in sorted(corpus.iterdir()) for _ in open(f))
    assert docs["train"] + docs["eval"] == total and abs(docs["eval"] - 0.05 * total) <= 6  # within 1 per file


def test_parts_refuse_mismatched_or_unfinished_work(corpus, tmp_path):
    out = tmp_path / "o"
    prepare(corpus, out, part=(0, 2), stage="map", **KW)
    with pytest.raises(ValueError, match=r"map task\(s\).*not done"):
        prepare(corpus, out, part=(0, 2), stage="reduce", **KW)
    with pytest.raises(ValueError, match="other inputs or settings"):
        prepare(corpus, out, part=(1, 2), stage="map", **{**KW, "seed": 4})
    with pytest.raises(ValueError, match="stage"):
        prepare(corpus, out, part=(1, 2), **KW)
    with pytest.raises(ValueError, match="tokenizer first"):
        prepare(corpus, out, part=(1, 2), stage="map", **{**KW, "tokenizer": "train"})


class Killed(BaseException):
    """Stands in for SIGKILL: nothing after it in the task runs (not an Exception, so nothing catches it)."""


def _killed_at(monkeypatch, module, name: str, call: int) -> None:
    """Make the `call`-th call of module.name (counted from 1) end the process, as a kill there would."""
    original, calls = getattr(module, name), []

    def dies(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise Killed
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, dies)


def test_a_killed_map_part_is_named(corpus, tmp_path, monkeypatch):
    """#24: a merge (or reduce) after a map part was killed names the part to rerun."""
    from meshformer.data import prepare_stages

    out = tmp_path / "o"
    prepare(corpus, out, part=(0, 2), stage="map", **KW)
    with monkeypatch.context() as patch:
        _killed_at(patch, prepare_stages, "_write_chunk", 1)  # part 1's first map task dies mid-way
        with pytest.raises(Killed):
            prepare(corpus, out, part=(1, 2), stage="map", **KW)
    for stage in ("reduce", "merge"):
        with pytest.raises(UsageError, match=r"map task\(s\) of .* are not done \(first: .*part-0001.jsonl; killed.*"
                                              r"rerun the same command with `--stage map --part 1/2`"):
            prepare(corpus, out, part=(0, 2), stage=stage, **KW)


@pytest.mark.parametrize("killed", ["merge", "reduce-rerun"])
def test_a_killed_merge_or_reduce_reruns_to_the_same_shards(corpus, tmp_path, monkeypatch, killed):
    """A merge killed while staging shards left the next merge a missing `.tar` (and the staged shards deleted);
    a reduce rerun killed after clearing its old shards left its old result, naming them, to the merge."""
    from meshformer.data import prepare_stages

    prepare_module = importlib.import_module("meshformer.data.prepare")  # the package exports the function
    out = tmp_path / "o"
    for stage in ("map", "reduce"):
        for i in range(2):
            prepare(corpus, out, part=(i, 2), stage=stage, **KW)
    with monkeypatch.context() as patch:
        if killed == "merge":
            _killed_at(patch, prepare_module, "ShardInfo", 3)  # two shards staged, then the merge dies
            with pytest.raises(Killed):
                prepare(corpus, out, part=(0, 2), stage="merge", **KW)
        else:
            _killed_at(patch, prepare_stages, "write_shards", 1)
            with pytest.raises(Killed):
                prepare(corpus, out, part=(1, 2), stage="reduce", **KW)
            with pytest.raises(UsageError, match=r"reduce task train bucket 1 of .* is not done .*rerun the same "
                                                  r"command with `--stage reduce --part 1/2`, then --stage merge"):
                prepare(corpus, out, part=(0, 2), stage="merge", **KW)
            prepare(corpus, out, part=(1, 2), stage="reduce", **KW)
    merged = prepare(corpus, out, part=(0, 2), stage="merge", **KW)
    whole = prepare(corpus, tmp_path / "whole", **KW)
    assert merged.to_json() == whole.to_json() and folder_bytes(out) == folder_bytes(tmp_path / "whole")


def test_buckets_mix_the_whole_corpus(corpus, tmp_path):
    """Two-level shuffle: consecutive documents of the prepared stream lie far apart in the input (mean gap
    about 1/3 of the corpus, as for a global shuffle; reading in input order would give ~0)."""
    m = prepare(corpus, tmp_path / "o", **KW)
    tok = tokenizer()
    total = sum(1 for f in sorted(corpus.iterdir()) for _ in open(f))
    ids = []
    for info in m.splits["train"]:
        records = read_shard(m.shard_url(info), info, m.dtype, None)
        text = tok.decode([t for i in range(info.samples) for t in records[i]["tokens"].tolist()])
        ids += [int(w[:7]) for w in text.split("doc ")[1:] if w[:7].isdigit()]
    assert len(ids) > 0.8 * total
    gap = np.mean(np.abs(np.diff(ids))) / total
    assert 0.25 < gap < 0.42, f"mean gap {gap:.3f} between consecutive documents"


def test_loader_reads_parted_shards(corpus, tmp_path):
    prepare_in_parts(corpus, tmp_path / "o", 2)
    loader = build_loader(config(tmp_path / "o", "data.seq_len=64"), tokenizer(), "train", 0, 1)
    assert next(loader)["input_ids"].shape == (4, 64)
    assert read_manifest(str(tmp_path / "o")).meta["documents"]["eval"] > 0


PEAK = textwrap.dedent("""
    import json, re, sys
    sys.path.insert(0, {root!r})
    from meshformer.data import prepare

    def status(key):
        return int(re.search(rf"{{key}}:\\s+(\\d+)", open("/proc/self/status").read()).group(1))

    open("/proc/self/clear_refs", "w").write("5")  # peak RSS (VmHWM) := current RSS, so imports do not count
    base = status("VmRSS")
    prepare({corpus!r}, {out!r}, tokenizer="bundled:kjv-bpe-4k", record_len=129, bucket_mb=1, progress=False)
    print(json.dumps([base, status("VmHWM")]))
""")


def peak_rss_kb(corpus, out) -> tuple[int, int]:
    """(RSS before prepare, peak RSS during it) of a fresh process, in KiB."""
    code = PEAK.format(root=str(ROOT_DIR), corpus=str(corpus), out=str(out))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return tuple(json.loads(done.stdout.strip().splitlines()[-1]))


def test_peak_memory_is_flat_in_corpus_size(tmp_path):
    """Corpus 1x and 10x (1 MB and 10 MB of text, 1 MB buckets): peak RSS within 20%, and the growth above the
    process's RSS before prepare within 16 MiB. Measured: +22 -> +29 MiB here; the previous prepare, which held
    the corpus, grew +29 -> +67 MiB (fails the second bound)."""
    base1, peak1 = peak_rss_kb(write_corpus(tmp_path / "c1", 1, files=4), tmp_path / "o1")
    base10, peak10 = peak_rss_kb(write_corpus(tmp_path / "c10", 10, files=40), tmp_path / "o10")
    assert peak10 <= 1.2 * peak1, f"peak RSS {peak1 / 1024:.0f} MiB at 1x but {peak10 / 1024:.0f} MiB at 10x"
    grew1, grew10 = (peak1 - base1) / 1024, (peak10 - base10) / 1024
    assert grew10 <= grew1 + 16, f"prepare grew the process by {grew1:.0f} MiB at 1x but {grew10:.0f} MiB at 10x"
