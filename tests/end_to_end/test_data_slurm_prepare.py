"""`meshformer data submit-prepare`: a prepare as SLURM array jobs (map, reduce, merge) on the local two-node
cluster (tools/slurm/start.sh; .ci/run starts it), giving the same shards as a one-process prepare.

Without sbatch the scheduler test skips, except under CI, where it fails (fixture shared with
test_cluster_slurm.py).
"""

from __future__ import annotations

import time

import pytest
from helpers.data import write_corpus
from test_cluster_slurm import slurm  # noqa: F401  (the running-scheduler fixture)

from meshformer.cli import main
from meshformer.data import prepare, read_manifest

ARGS = ["--tokenizer", "bundled:kjv-bpe-4k", "--record-len", "65", "--shard-records", "20", "--bucket-mb", "0.03",
        "--seed", "5"]


def test_dry_run_scripts_chain_three_stages(tmp_path, capsys):
    main(["data", "submit-prepare", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--parts", "3",
          "--sbatch=--partition=cpu", "--dry-run", *ARGS])
    scripts = capsys.readouterr().out.split("#!/bin/bash")[1:]
    assert len(scripts) == 3
    for stage, script in zip(("map", "reduce", "merge"), scripts):
        assert f"--stage {stage}" in script and "#SBATCH --partition=cpu" in script
        assert ("#SBATCH --array=0-2" in script) == (stage != "merge")
        assert ("--part slurm" in script) == (stage != "merge")


def test_part_slurm_reads_the_array_task(monkeypatch, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "c", 0.05, files=2)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--part", "slurm", "--stage", "map",
              *ARGS])
    assert "SLURM_ARRAY_TASK_ID" in str(exit_info.value.code)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    main(["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--part", "slurm", "--stage", "map",
          "--quiet", *ARGS])
    assert [p.name for p in sorted((tmp_path / "o.work" / "map").glob("*.done.json"))] == ["u000001.done.json"]


def test_array_prepare_on_the_slurm_cluster(slurm, tmp_path, capsys):  # noqa: F811
    corpus = write_corpus(tmp_path / "c", 0.2, files=5)
    out = tmp_path / "o"
    main(["data", "submit-prepare", str(corpus), "--out", str(out), "--parts", "3", *ARGS])
    assert "submitted map" in capsys.readouterr().out
    deadline = time.time() + 600
    while not (out / "manifest.json").exists():
        logs = sorted((tmp_path / "o.slurm").glob("*.out"))
        failed = [p for p in logs if "Traceback" in p.read_text() or "error:" in p.read_text()]
        assert not failed, failed[0].read_text()[-2000:]
        assert time.time() < deadline, "the prepare jobs did not finish in 10 minutes"
        time.sleep(2)
    time.sleep(1)  # the merge renames a complete folder into place; let its job end
    reference = prepare(corpus, tmp_path / "ref", tokenizer="bundled:kjv-bpe-4k", record_len=65, shard_records=20,
                        bucket_mb=0.03, seed=5, progress=False)
    assert read_manifest(str(out)).to_json() == reference.to_json()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in
                                                              (tmp_path / "ref").iterdir()}
    maps = sorted(p.name for p in (tmp_path / "o.slurm").glob("map-*.out"))
    assert len(maps) == 3  # three array tasks ran the map stage
