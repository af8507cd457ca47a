"""The run folder as a record (train/run_record.py): configs/config-step<N>.toml is the config that trained the
run up to step N, whatever later re-runs that continue from that same step do; --new-run finds a folder beside
any run folder, also one named by a relative path."""

from __future__ import annotations

from pathlib import Path

from helpers.common import CONFIGS

from meshformer.config import load_config
from meshformer.train.run_record import (
    CONFIG_HISTORY,
    RUN_CONFIG,
    config_changes,
    history_name,
    new_run_dir,
    record_config,
)


def test_a_second_continuation_from_the_same_step_keeps_the_config_that_trained_it(tmp_path):
    first, second, third = (load_config(CONFIGS / "tiny-gpt.toml", [f"optim.lr={lr}"]) for lr in (1e-3, 2e-3, 3e-3))
    run, log = tmp_path / "run", []
    run.mkdir()
    (run / RUN_CONFIG).write_text(first.to_toml())  # `first` trained the run to step 10 (its newest checkpoint)
    record_config(second, run, 10, config_changes(run, second), log.append)
    # `second` stopped before its next checkpoint: the next re-run continues from step 10 again
    record_config(third, run, 10, config_changes(run, third), log.append)
    assert (run / CONFIG_HISTORY / history_name(10)).read_text() == first.to_toml()
    assert (run / RUN_CONFIG).read_text() == third.to_toml()
    assert len(log) == 2 and "optim.lr: 0.002 -> 0.003" in log[1]


def test_config_changes_are_written_as_in_a_config_not_as_python_reprs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_CONFIG).write_text(load_config("tiny-gpt").to_toml())
    changed = load_config("tiny-gpt", ["data.shards=data/mine", "optim.betas=[0.8, 0.9]", "logging.tensorboard=false"])
    changes = config_changes(run, changed)
    assert 'data.shards: "" -> "data/mine"' in changes and "optim.betas: [0.9, 0.95] -> [0.8, 0.9]" in changes
    assert "logging.tensorboard: true -> false" in changes
    assert not any("'" in change or "None" in change or "True" in change for change in changes), changes


def test_new_run_beside_a_run_folder_named_dot(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    monkeypatch.chdir(run)  # logging.run_dir = "." from inside the run folder
    assert new_run_dir(Path(".")) == run.with_name("run-2")
