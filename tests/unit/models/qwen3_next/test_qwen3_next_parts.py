"""Qwen3-Next's other pieces against transformers' modules with copied weights, in fp32: gated attention (a sigmoid
output gate per head from the query projection) with partial RoPE and (1 + weight) QK-norm on a padded batch, the
zero-centred RMSNorm, the MoE block with its gated shared expert; parameter counts and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshformer.config import ConfigError, config_from_dict
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.attention import Attention
from meshformer.model.config import ModelConfig
from meshformer.model.flops import count_params
from meshformer.model.masks import build_mask
from meshformer.model.moe import MoEFeedForward
from meshformer.model.norms import make_norm
from meshformer.model.positions import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 16


def hf_config(**extra: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=40, hidden_size=D, intermediate_size=48, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=32, layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    config = transformers.Qwen3NextConfig(**{**fields, **extra})
    config._attn_implementation = "eager"
    return config


def ours(**extra: Any) -> ModelConfig:
    cfg = model_from_flat(**{"vocab_size": 40, "d_model": D, "n_heads": HEADS, "n_kv_heads": KV_HEADS,
                             "head_dim": HEAD_DIM, "n_layers": 1, "position": "rope", "norm": "rmsnorm",
                             "norm_eps": 1e-6, "norm_weight_offset": 1.0, "qk_norm": True, "bias": False,
                             "activation": "swiglu", "n_experts": 4, "experts_per_token": 2, "moe_d_ff": 16,
                             "n_shared_experts": 2, **extra})
    cfg.attention.output_gate, cfg.rope.partial_factor, cfg.moe.shared_expert_gate = True, 0.25, True
    return cfg


@torch.no_grad()
def perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Every weight away from its init. transformers allocates a standalone experts module's stacked weights
    uninitialised (its model's init fills them), so those are drawn here first."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith("experts."):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            p.add_(0.3 * torch.randn(p.shape, generator=gen))


def test_gated_attention_with_partial_rope_matches_transformers() -> None:
    torch.manual_seed(0)
    config = hf_config()
    theirs = hf.Qwen3NextAttention(config, layer_idx=0).eval()
    perturb(theirs)
    cfg = ours()
    mine = Attention(cfg, causal=True).eval()
    mine.load_state_dict(theirs.state_dict(), strict=False)
    assert set(theirs.state_dict()) <= set(mine.state_dict())
    assert mine.q_proj.weight.shape == (2 * HEADS * HEAD_DIM, D)  # each head's query rows, then its gate rows
    batch, length = 3, 10
    x = torch.randn(batch, length, D)
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[1, 7:] = False
    padding[2, :3] = False
    positions = torch.arange(length)
    cos, sin = hf.Qwen3NextRotaryEmbedding(config)(x, positions[None])
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    rope = RotaryEmbedding(cfg.rope_dim, 64, cfg.rope.theta)(positions)
    assert cfg.rope_dim == 4 and rope[0].shape == (length, 4)
    with torch.no_grad():
        expected, _ = theirs(x, (cos, sin), additive)
        got = mine(x, build_mask(length, length, causal=True, key_padding=padding), rope=rope)
    rows = padding.clone()
    rows[2, :3] = False  # a query with no real key before it is don't-care output
    torch.testing.assert_close(got[rows], expected[rows], atol=1e-5, rtol=1e-5)


def test_zero_centred_rmsnorm_matches_transformers() -> None:
    theirs = hf.Qwen3NextRMSNorm(D, eps=1e-6)
    perturb(theirs)
    mine = make_norm(ours())
    mine.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, D)
    with torch.no_grad():
        torch.testing.assert_close(mine(x), theirs(x), atol=1e-6, rtol=1e-6)


def test_moe_block_with_gated_shared_expert_matches_transformers() -> None:
    torch.manual_seed(0)
    theirs = hf.Qwen3NextSparseMoeBlock(hf_config()).eval()
    perturb(theirs)
    mine = MoEFeedForward(ours()).eval()
    width = 16
    state = theirs.state_dict()
    gate_up = state["experts.gate_up_proj"]  # (E, 2f, d): gate rows then up rows
    with torch.no_grad():
        mine.router.weight.copy_(state["gate.weight"])
        mine.experts.gate_proj.copy_(gate_up[:, :width].transpose(1, 2))
        mine.experts.up_proj.copy_(gate_up[:, width:].transpose(1, 2))
        mine.experts.down_proj.copy_(state["experts.down_proj"].transpose(1, 2))
        for p in ("gate", "up", "down"):
            getattr(mine.shared_experts, f"{p}_proj").weight.copy_(state[f"shared_expert.{p}_proj.weight"])
        mine.shared_expert_gate.weight.copy_(state["shared_expert_gate.weight"])
        x = torch.randn(2, 7, D)
        torch.testing.assert_close(mine(x), theirs(x), atol=1e-5, rtol=1e-5)
        mine.shared_expert_gate = None  # the gate matters
        assert (mine(x) - theirs(x)).abs().max() > 1e-3


def test_parameter_counts_equal_the_built_models() -> None:
    cfg = ours(n_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention"], moe_first_dense=1)
    for config in (cfg, ours(n_layers=2, n_experts=0, d_ff=48, layer_types=["linear_attention", "full_attention"])):
        built = sum(p.numel() for p in Transformer(config).parameters())
        assert count_params(config)["total"] == built


@pytest.mark.parametrize(("model", "parallel", "named"), [
    ({"linear_attention": {"n_heads": 4, "n_key_heads": 3}}, {}, "n_key_heads=3 must divide n_heads=4"),
    ({"moe": {"n_experts": 4, "shared_expert_gate": True}}, {}, "shared_expert_gate=true gates the shared experts"),
    ({"rope": {"partial_factor": 0.1}, "position": "rope"}, {}, "partial_factor=0.1 must rotate an even number"),
    ({"linear_attention": {"n_heads": 4, "n_key_heads": 2}}, {"tp": 4},
     r"^parallel\.tp=4 does not divide model\.linear_attention\.n_key_heads=2 \(Gated DeltaNet heads are split "
     r"across tensor-parallel ranks\); choose a tp that divides"),
])
def test_refusals_name_the_key(model: dict, parallel: dict, named: str) -> None:
    from meshformer.parallel_dims import validate_parallel

    base = {"d_model": 32, "n_layers": 2, "vocab_size": 64, "layer_types": ["linear_attention", "full_attention"],
            "attention": {"n_heads": 4}}
    with pytest.raises(ConfigError, match=named):
        cfg = config_from_dict({"model": {**base, **model}, "parallel": parallel, "data": {"seq_len": 32}})
        validate_parallel(cfg, max(2, parallel.get("tp", 1)), "cpu")
