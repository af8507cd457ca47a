"""Run folders, checkpoints and weights written by an earlier meshformer keep loading and resuming
(tests/fixtures/README.md says what each fixture is)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.common import ROOT
from helpers.data import shards

from meshformer.checkpointing.directory import committed_steps
from meshformer.checkpointing.weights import load_weights
from meshformer.cli import main

FIXTURES = ROOT / "tests" / "fixtures"


def test_a_run_folder_of_commit_1ed6c24_resumes_and_its_weights_load(tmp_path, one_thread, capsys):
    run = shutil.copytree(FIXTURES / "run_1ed6c24", tmp_path / "run")
    model = load_weights(run / "final").eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]]))
    assert logits.shape[-1] == model.cfg.vocab_size and torch.isfinite(logits).all()

    main(["train", str(run / "config.toml"), "--set", f"logging.run_dir={run}", f"data.shards={shards(tmp_path)}",
          "train.steps=3", "data.reseed_on_resume=true"])  # the data it trained on was prepared elsewhere
    err = capsys.readouterr().err
    assert "resumed from" in err and "(step 2," in err, err[-3000:]
    assert committed_steps(run / "checkpoints")[-1] == 3
    resumed = json.loads((run / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert resumed["contents"] == "training" and "kind" not in resumed  # the old key is read, never written
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[:2] == [1, 2] and 3 in steps


@pytest.mark.slow  # a resumed training run (~10 s)
def test_a_muon_run_of_commit_e9ebde0_resumes_with_its_groups_keyed_by_update(tmp_path, one_thread, capsys):
    """Its checkpoint names each Muon parameter group's update `kind`; the resumed run steps each group by its
    saved update and writes the key as `update`."""
    run = shutil.copytree(FIXTURES / "run_e9ebde0_muon", tmp_path / "run")
    saved = json.loads((run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())["param_groups"]
    assert [g["kind"] for g in saved] == ["adamw", "adamw", "muon"]
    main(["train", str(run / "config.toml"), "--set", f"logging.run_dir={run}", f"data.shards={shards(tmp_path)}",
          "train.steps=3", "data.reseed_on_resume=true"])
    err = capsys.readouterr().err
    assert "resumed from" in err and "(step 2," in err, err[-3000:]
    groups = json.loads((run / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())["param_groups"]
    assert [g["update"] for g in groups] == ["adamw", "adamw", "muon"]
    assert all("kind" not in g for g in groups)
