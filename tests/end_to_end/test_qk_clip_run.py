"""MuonClip through `Trainer`: the log carries the largest attention logit and the heads clipped, and a run with
QK-clip resumes bitwise (the recorded maxima restart every step, so no state is lost at a checkpoint)."""

from __future__ import annotations

from helpers.checkpoints import assert_bitwise, final_weights, run_trainer, tiny_config, tiny_shards

STEPS = 4
# a threshold far below the tiny model's first logits (about 0.06): every head clips at the first step
CLIP = ('optim.name="muon"', "optim.muon.lr=0.01", "optim.qk_clip_threshold=0.01", "logging.log_interval=1")


def test_qk_clip_is_logged_and_resumes_bitwise(tmp_path):
    shards = tiny_shards(tmp_path)
    trainer, result = run_trainer(tiny_config(shards, tmp_path / "whole", STEPS, *CLIP))
    heads = trainer.cfg.model.n_layers * trainer.cfg.model.attention.n_heads
    logged = [line for line in result.history if "optim/qk_clip_heads" in line]
    assert len(logged) == STEPS
    first = logged[0]
    assert first["optim/qk_clip_heads"] == heads and first["optim/max_attention_logit"] > 5 * 0.01
    # after the first clip each head's logits start the next step at 0.01 at most (up to the update's change)
    assert all(line["optim/max_attention_logit"] < 2 * 0.01 for line in logged[1:])

    cfg = tiny_config(shards, tmp_path / "run", STEPS, *CLIP)
    trainer, result = run_trainer(cfg, crash_after=3)
    assert result is None
    trainer, result = run_trainer(cfg)
    assert result.steps == STEPS
    assert_bitwise(final_weights(tmp_path / "run"), final_weights(tmp_path / "whole"))
