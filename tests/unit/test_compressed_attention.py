"""DeepSeek-V4's pieces (model/compressed_attention.py) against transformers 5.24's modules, fp32, random weights:
the grouped output projection, the heavily compressed attention's compressor (whole-sequence path) and hash
routing."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4GroupedLinear,
    DeepseekV4HashRouter,
    DeepseekV4HCACompressor,
)

from meshformer.model.compressed_attention import GroupedOutputProjection, HashRouter, HeavyCompressor

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, HEAD_DIM, ROPE = 32, 4, 16, 4


def hf_config(**fields) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=D, num_attention_heads=HEADS, head_dim=HEAD_DIM, partial_rotary_factor=ROPE /
                            HEAD_DIM, q_lora_rank=16, o_groups=2, o_lora_rank=8, num_hidden_layers=1, vocab_size=64,
                            n_routed_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
                            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4},
                            **fields)


def randomise(module: nn.Module) -> None:
    for p in module.parameters():
        nn.init.normal_(p, std=0.3)


@torch.no_grad()
def test_grouped_output_projection_equals_transformers():
    torch.manual_seed(0)
    cfg = hf_config()
    theirs_a = DeepseekV4GroupedLinear(HEADS * HEAD_DIM // 2, 2 * 8, 2)
    theirs_b = nn.Linear(2 * 8, D, bias=False)
    ours = GroupedOutputProjection(HEADS * HEAD_DIM, groups=cfg.o_groups, rank=cfg.o_lora_rank, d_model=D)
    randomise(theirs_a), randomise(theirs_b)
    ours.o_a_proj.copy_(theirs_a.weight), ours.o_b_proj.weight.copy_(theirs_b.weight)
    x = torch.randn(2, 5, HEADS * HEAD_DIM)
    expected = theirs_b(theirs_a(x.reshape(2, 5, 2, -1)).flatten(2))
    torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="groups"):
        GroupedOutputProjection(30, groups=4, rank=2, d_model=D)


@torch.no_grad()
def test_heavy_compressor_equals_transformers_over_a_sequence_longer_than_its_windows():
    """Eleven tokens at rate 4: two whole windows (the third, partial, is left out), rotated at positions 0 and 4;
    each query sees a window only once it has passed its end."""
    torch.manual_seed(1)
    cfg = hf_config()
    theirs = DeepseekV4HCACompressor(cfg)
    randomise(theirs)
    ours = HeavyCompressor(D, HEAD_DIM, rate=4, rope_dim=ROPE, rope_theta=cfg.compress_rope_theta, eps=1e-6)
    ours.load_state_dict({k: v for k, v in theirs.state_dict().items() if "rotary" not in k})
    x = torch.randn(2, 11, D)
    positions = torch.arange(11)
    compressed, bias = theirs(x, None, positions[None].expand(2, -1), None, 0)
    ours_kv, visible = ours(x, positions)
    assert ours_kv.shape == (2, 2, HEAD_DIM)
    torch.testing.assert_close(ours_kv, compressed[:, 0], rtol=0, atol=1e-5)
    assert torch.equal(visible, bias[0, 0] == 0)
    assert visible[3].tolist() == [True, False] and not visible[2].any() and visible[10].all()


@torch.no_grad()
def test_hash_router_equals_transformers():
    """Fixed experts per token id (the table a checkpoint ships); the gate's sqrt-softplus scores weigh them."""
    torch.manual_seed(2)
    cfg = hf_config()
    theirs = DeepseekV4HashRouter(cfg)
    randomise(theirs)
    theirs.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(64)]))
    ours = HashRouter(D, n_experts=8, top_k=2, vocab_size=64, scale=cfg.routed_scaling_factor)
    ours.weight.copy_(theirs.weight), ours.experts_of_token.copy_(theirs.tid2eid)
    x, ids = torch.randn(2, 5, D), torch.randint(0, 64, (2, 5))
    _, expected_weights, expected_indices = theirs(x, ids)
    weights, indices = ours(x, ids)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-6)
