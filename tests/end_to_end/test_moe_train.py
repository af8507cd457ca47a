"""A mixture-of-experts decoder through the trainer: it trains, logs its balance per layer, saves, and a crash and
restart is the same run, bit for bit (the balance losses in the objective, the experts' stacked weights and the
routers' bias-balancing state in the checkpoint)."""

from __future__ import annotations

import torch
from helpers.checkpoints import assert_bitwise, final_weights, run_trainer, tiny_config, tiny_shards

MOE = ("model.moe.n_experts=4", "model.moe.experts_per_token=2", "model.moe.n_shared_experts=1", "model.moe.d_ff=32",
       "model.moe.aux_loss=0.01", "model.moe.router_z_loss=0.001", "model.moe.router_bias_update_rate=0.01")
STEPS = 6


def test_moe_run_trains_and_resumes_bitwise(tmp_path):
    shards = tiny_shards(tmp_path)
    _, reference = run_trainer(tiny_config(shards, tmp_path / "reference", STEPS, *MOE))
    assert reference.history[-1]["train/loss"] < reference.history[0]["train/loss"]
    logged = reference.history[-1]
    for layer in ("decoder_layers.0", "decoder_layers.1"):  # both blocks are MoE
        assert logged[f"moe/{layer}/load_max_over_mean"] >= 1.0
        assert 0 < logged[f"moe/{layer}/aux_loss"] < 4  # n_experts at worst, about 1 when balanced
        assert logged[f"moe/{layer}/z_loss"] > 0
        assert logged[f"moe/{layer}/dropped_fraction"] == 0.0  # dropless
    assert final_weights(tmp_path / "reference")["decoder_layers.0.ffn.router.expert_bias"].abs().max() > 0
    cfg = tiny_config(shards, tmp_path / "interrupted", STEPS, *MOE)
    trainer, result = run_trainer(cfg, crash_after=3)
    assert result is None and trainer.step == 3
    _, result = run_trainer(cfg)
    assert result.steps == STEPS
    assert_bitwise(final_weights(tmp_path / "interrupted"), final_weights(tmp_path / "reference"))
    assert [h["train/loss"] for h in result.history] == [h["train/loss"] for h in reference.history[2:]]


def test_a_checkpoint_saved_before_router_biases_were_resumes_with_them_at_zero(tmp_path, monkeypatch):
    """Checkpoints written while the routers' biases were not saved hold every other tensor: they resume (the biases
    at zero, as every resume of those runs had them, and said so), where a missing tensor otherwise refuses."""
    from meshformer.checkpointing.dcp_io import read_full_tensors
    from meshformer.checkpointing.directory import committed_steps, step_dir_name
    from meshformer.model.moe import Router
    from meshformer.train.trainer import Trainer

    cfg = tiny_config(tiny_shards(tmp_path), tmp_path / "run", STEPS, *MOE)
    built = Router.__init__

    def router_of_old(self, model_cfg) -> None:  # the bias a buffer outside the state dict, as it was
        built(self, model_cfg)
        self._non_persistent_buffers_set.add("expert_bias")

    with monkeypatch.context() as patched:
        patched.setattr(Router, "__init__", router_of_old)
        run_trainer(cfg, crash_after=3)
    step = committed_steps(tmp_path / "run" / "checkpoints")[-1]
    saved = read_full_tensors(tmp_path / "run" / "checkpoints" / step_dir_name(step))
    assert saved and not any(k.endswith("expert_bias") for k in saved)

    trainer = Trainer(cfg)
    messages: list[str] = []
    trainer.checkpoints.log = messages.append
    assert trainer.checkpoints.resume(trainer.checkpointable) and trainer.step == step
    here = trainer.model.state_dict()
    experts = "decoder_layers.1.ffn.experts.up_proj"
    assert torch.equal(here[experts], saved["model." + experts])
    assert not here["decoder_layers.0.ffn.router.expert_bias"].any()
    assert any("holds no MoE router biases" in m for m in messages), messages
    assert trainer.fit().steps == STEPS
