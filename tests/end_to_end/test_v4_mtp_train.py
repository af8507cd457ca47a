"""DeepSeek-V4's multi-token prediction through the trainer: tiny-v4 (mHC, every V4 attention kind, hash routing)
shrunk, with one MTP module (a sliding_mqa / moe block reading the streams), trains: the main and the module's losses
fall, and the module's weights are in the run's final weights."""

from __future__ import annotations

import pytest
from helpers.checkpoints import final_weights, run_trainer, tiny_overrides, tiny_shards

from meshformer.config import load_config

V4 = ("model.d_model=32", "model.n_layers=3", "model.layer_types=['sliding_mqa', 'csa', 'hca']",
      "model.mlp_types=['hash_moe', 'moe', 'moe']", "model.attention.n_heads=2", "model.attention.head_dim=16",
      "model.compressed_attention.q_rank=16", "model.compressed_attention.o_rank=16",
      "model.compressed_attention.rope_dim=8", "model.compressed_attention.window=8",
      "model.compressed_attention.index_dim=8", "model.compressed_attention.index_topk=4",
      "model.compressed_attention.hca_rate=8", "model.moe.n_experts=4", "model.moe.d_ff=32", "model.ffn.d_ff=32",
      "model.mtp.depth=1", "train.dtype=fp32", "optim.lr=1e-2", "checkpoint.interval=8")
STEPS = 8


@pytest.mark.slow
def test_tiny_v4_with_mtp_trains(tmp_path):
    shards = tiny_shards(tmp_path)
    cfg = load_config("tiny-v4", tiny_overrides(shards, tmp_path / "run", STEPS, *V4))
    assert cfg.model.mtp.layer_type == "sliding_mqa" and cfg.model.residual.kind == "mhc"
    _, result = run_trainer(cfg)
    first, last = result.history[0], result.history[-1]
    assert last["train/loss"] < first["train/loss"] - 0.5  # 8.30 -> 7.27 when written
    assert last["mtp/loss_1"] < first["mtp/loss_1"] - 0.5  # the module learns too
    weights = final_weights(tmp_path / "run")
    assert {"mtp_layers.0.h_proj.weight", "mtp_layers.0.merge.weight", "mtp_layers.0.block.attn.sinks"} <= set(weights)
