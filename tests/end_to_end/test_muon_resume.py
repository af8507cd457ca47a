"""Muon's state (one momentum buffer per matrix) checkpoints and resumes exactly; a resume with another optimizer is
refused in one line, or loads the weights alone under checkpoint.load_mode="partial"."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import assert_bitwise, copy_steps, final_weights, run_trainer, tiny_config, tiny_shards

from meshformer.checkpointing import CheckpointError
from meshformer.checkpointing.dcp_io import read_full_tensors
from meshformer.checkpointing.directory import committed_steps, step_dir_name
from meshformer.optim.muon import Muon

STEPS = 4
MUON = ('optim.name="muon"', "optim.muon.lr=0.01")


def _state(trainer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {f"{names[id(p)]}.{k}": v.clone() for p, s in trainer.optimizer.state.items() for k, v in s.items()}


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("muon")
    shards = tiny_shards(root)
    run_dir = root / "reference"
    trainer, result = run_trainer(tiny_config(shards, run_dir, STEPS, *MUON))
    assert isinstance(trainer.optimizer, Muon)
    return {"shards": shards, "run_dir": run_dir, "weights": final_weights(run_dir), "state": _state(trainer),
            "history": result.history}


def test_muon_crash_and_restart_is_bitwise(muon_run, tmp_path):
    cfg = tiny_config(muon_run["shards"], tmp_path / "run", STEPS, *MUON)
    trainer, result = run_trainer(cfg, crash_after=3)
    assert result is None and committed_steps(tmp_path / "run" / "checkpoints") == [2]
    saved = read_full_tensors(tmp_path / "run" / "checkpoints" / step_dir_name(2))
    assert "optim.decoder_layers.0.attn.q_proj.weight.momentum_buffer" in saved  # Muon's one buffer
    assert "optim.decoder_layers.0.attn.q_proj.weight.exp_avg" not in saved
    assert "optim.tok_embeddings.weight.exp_avg_sq" in saved  # AdamW's two moments for the rest
    trainer, result = run_trainer(cfg)
    assert result.steps == STEPS
    assert_bitwise(final_weights(tmp_path / "run"), muon_run["weights"])
    assert_bitwise(_state(trainer), muon_run["state"])


def test_resume_with_another_optimizer_is_refused_or_loads_weights_alone(muon_run, tmp_path):
    copy_steps(muon_run["run_dir"] / "checkpoints", tmp_path / "run" / "checkpoints", 2)
    cfg = tiny_config(muon_run["shards"], tmp_path / "run", STEPS)  # AdamW
    with pytest.raises(CheckpointError, match=r"holds Muon state but this run uses AdamW \(optim.name\).*"
                                              r"load_mode=\"partial\"") as err:
        run_trainer(cfg)
    assert "\n" not in err.value.one_line()

    from meshformer.train.trainer import Trainer

    partial = tiny_config(muon_run["shards"], tmp_path / "run", STEPS, 'checkpoint.load_mode="partial"')
    trainer = Trainer(partial)
    messages: list[str] = []
    trainer.checkpoints.log = messages.append
    assert trainer.checkpoints.resume(trainer.checkpointable)
    assert trainer.step == 2 and not trainer.optimizer.state  # weights and position loaded, AdamW starts fresh
    saved = read_full_tensors(tmp_path / "run" / "checkpoints" / step_dir_name(2))
    assert torch.equal(trainer.model.state_dict()["decoder_layers.0.attn.q_proj.weight"],
                       saved["model.decoder_layers.0.attn.q_proj.weight"])
    assert any("holds Muon state, this run uses AdamW" in m and "starts fresh" in m for m in messages), messages
    trainer.fit()
    assert trainer.step == STEPS
