"""Multi-token prediction through the trainer: a DeepSeek-style decoder with one MTP module trains, logs
`mtp/loss_1`, and a crash and restart is the same run, bit for bit (the modules' weights and optimizer state in the
checkpoint)."""

from __future__ import annotations

from helpers.checkpoints import assert_bitwise, final_weights, run_trainer, tiny_config, tiny_shards

MTP = ("model.position=rope", "model.layer_types=['mla']", "model.norm.kind=rmsnorm", "model.bias=false",
       "model.moe.n_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=32", "model.moe.router_score=sigmoid",
       "model.mlp_types=['dense', 'moe']", "model.mtp.depth=1", "model.mtp.loss_weight=0.3",
       # MLA widths within the tiny d_model of 32
       "model.mla.kv_lora_rank=32", "model.mla.qk_nope_head_dim=16", "model.mla.qk_rope_head_dim=16")
STEPS = 6


def test_mtp_run_trains_logs_and_resumes_bitwise(tmp_path):
    shards = tiny_shards(tmp_path)
    _, reference = run_trainer(tiny_config(shards, tmp_path / "reference", STEPS, *MTP))
    first, last = reference.history[0], reference.history[-1]
    assert last["train/loss"] < first["train/loss"]
    assert last["mtp/loss_1"] < first["mtp/loss_1"]  # the module learns too
    assert last["mtp/loss_1"] > last["train/loss"]  # two tokens ahead is harder than one
    assert any(name.startswith("mtp_layers.0.eh_proj") for name in final_weights(tmp_path / "reference"))
    cfg = tiny_config(shards, tmp_path / "interrupted", STEPS, *MTP)
    trainer, result = run_trainer(cfg, crash_after=3)
    assert result is None and trainer.step == 3
    _, result = run_trainer(cfg)
    assert result.steps == STEPS
    assert_bitwise(final_weights(tmp_path / "interrupted"), final_weights(tmp_path / "reference"))
    assert [h["mtp/loss_1"] for h in result.history] == [h["mtp/loss_1"] for h in reference.history[2:]]
