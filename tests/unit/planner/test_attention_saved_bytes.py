"""The attention kind's planner bytes (model/components/attention.py `saved_bytes`) against the tensors a block's
autograd graph keeps, measured with saved-tensor hooks (parameters excluded), for the pieces Qwen3-Next's gated
attention adds: QK-norm per head or per projection, the output gate, partial rotary."""

from __future__ import annotations

import pytest
import torch

from meshformer.config import load_config
from meshformer.model.transformer import Transformer
from meshformer.planner.activations import activation_shape, block_saved
from meshformer.planner.measure import saved_activation_bytes

BASE = ["model.moe.n_experts=0", 'model.mlp_types=["dense"]', "model.vocab_size=256",
        'model.layer_types=["full_attention"]', "model.attention.document_mask=false", "model.n_layers=2",
        "model.max_seq_len=512", "data.seq_len=512", "data.batch_size=1"]


@pytest.mark.parametrize("overrides", [
    ["model.attention.qk_norm=false", "model.attention.output_gate=false", "model.rope.partial_factor=1.0"],
    ["model.attention.qk_norm=true", "model.attention.qk_norm_scope=head", "model.attention.output_gate=false",
     "model.rope.partial_factor=1.0"],
    ["model.attention.qk_norm=true", "model.attention.qk_norm_scope=projection", "model.attention.output_gate=false",
     "model.rope.partial_factor=1.0"],
    ["model.attention.qk_norm=false", "model.attention.output_gate=true", "model.rope.partial_factor=1.0"],
    []])  # all three, with partial rotary (half the head width)
def test_planned_bytes_follow_what_autograd_keeps(overrides: list[str]) -> None:
    cfg = load_config("tiny-qwen3-next", [*BASE, *overrides])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    h = torch.randn(1, cfg.data.seq_len, cfg.model.d_model, requires_grad=True)
    ids = torch.zeros(1, cfg.data.seq_len, dtype=torch.long)
    kept = saved_activation_bytes(model, lambda: model.decode(ids, h=h, final_norm=False))
    shape = activation_shape(cfg, 1, 1, False, device_type="cpu")
    planned = sum(block_saved(cfg.model, shape, index=i) for i in range(cfg.model.n_layers))
    assert abs(planned / kept - 1) < 0.08, (planned, kept)


@pytest.mark.parametrize("kind", ["sliding_mqa", "hca", "csa"])
def test_v4_planned_bytes_follow_what_autograd_keeps(kind: str) -> None:
    """DeepSeek-V4's attention kinds (model/components/v4_attention.py): 640 tokens in query blocks of 256 (the last
    one partial), each against its window's keys and the entries it may see (HCA) or picks (CSA)."""
    cfg = load_config("tiny-v4", ['model.mlp_types=["dense"]', f'model.layer_types=["{kind}"]', "model.n_layers=1",
                                  "model.moe.n_experts=0", 'model.residual.kind="plain"', "model.vocab_size=256",
                                  "model.max_seq_len=640", "data.seq_len=640", "data.batch_size=1"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    h = torch.randn(1, cfg.data.seq_len, cfg.model.d_model, requires_grad=True)
    ids = torch.zeros(1, cfg.data.seq_len, dtype=torch.long)
    kept = saved_activation_bytes(model, lambda: model.decode(ids, h=h, final_norm=False))
    planned = block_saved(cfg.model, activation_shape(cfg, 1, 1, False, device_type="cpu"))
    assert abs(planned / kept - 1) < 0.01, (planned, kept)


@pytest.mark.parametrize("method", ["allgather", "ulysses"])
@pytest.mark.parametrize("kind", ["sliding_mqa", "hca", "csa"])
def test_v4_planned_bytes_under_context_parallel_follow_what_autograd_keeps(kind: str, method: str) -> None:
    """The same under cp = 2 (threads exchanging through an in-process all-gather): rank 0's pieces of 1,280 tokens,
    its queries against the whole sequence's key/value head and entries; under Ulysses its half of the heads over
    the whole sequence (query blocks over all 1,280 positions, CSA's picks all-gathered)."""
    from helpers.allgather_threads import pieces, run_ranks

    from meshformer.model.components import token_mixer

    cfg = load_config("tiny-v4", [f'model.layer_types=["{kind}"]', "model.n_layers=1", 'model.mlp_types=["dense"]',
                                  "model.moe.n_experts=0", "model.max_seq_len=1280",
                                  "data.seq_len=1280", "data.batch_size=1", "parallel.cp=2",
                                  f'parallel.cp_method="{method}"'])
    torch.manual_seed(0)
    module = token_mixer(cfg.model, 0).build(cfg.model, causal=True)
    x = torch.randn(1, cfg.data.seq_len, cfg.model.d_model, requires_grad=True)

    def rank(chunk):  # type: ignore[no-untyped-def]
        mine = pieces(x, chunk)
        return saved_activation_bytes(module, lambda: module(mine, None, chunk=chunk))

    kept = run_ranks(2, rank, ulysses=method == "ulysses")[0]
    shape = activation_shape(cfg, 1, 1, False, device_type="cpu", cp=2)
    assert shape.ulysses == (method == "ulysses")
    planned = token_mixer(cfg.model, 0).saved_bytes(cfg.model, shape, memory_len=0, causal=True)
    assert abs(planned / kept - 1) < 0.01, (planned, kept)
