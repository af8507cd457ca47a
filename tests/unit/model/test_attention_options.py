"""Attention options of the models people continue pretraining: RoPE scaling against transformers' definitions,
explicit head_dim, QK-norm, Q/K/V-only biases; each counted, trainable, and equal with and without the KV cache
(Gemma's and OLMo 2's block options too)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshformer.config import ConfigError, ModelConfig, config_from_dict
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.flops import count_params
from meshformer.model.masks import AttentionMask
from meshformer.model.positions import RopeScaling, RotaryEmbedding, apply_rope, rope_frequencies

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64

# (HF rope_parameters beyond rope_type and rope_theta, our ModelConfig keys), for head_dim 64 / theta 500000
# and head_dim 16 / theta 10000: Llama 3.1's and Qwen's published settings and small variants
SCALINGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("linear", {"factor": 4.0}, {"rope_scaling_factor": 4.0}),
    ("linear", {"factor": 1.5}, {"rope_scaling_factor": 1.5}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
     {"rope_scaling_factor": 8.0, "rope_original_max_seq_len": 8192}),
    ("llama3", {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                "original_max_position_embeddings": 64},
     {"rope_scaling_factor": 32.0, "rope_low_freq_factor": 2.0, "rope_high_freq_factor": 8.0,
      "rope_original_max_seq_len": 64}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 8192},
     {"rope_scaling_factor": 4.0, "rope_original_max_seq_len": 8192}),
    ("yarn", {"factor": 2.0, "original_max_position_embeddings": 256, "beta_fast": 16.0, "beta_slow": 2.0},
     {"rope_scaling_factor": 2.0, "rope_original_max_seq_len": 256, "rope_beta_fast": 16.0, "rope_beta_slow": 2.0}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3},
     {"rope_scaling_factor": 8.0, "rope_original_max_seq_len": 1024, "rope_attention_factor": 1.3}),
    # gpt-oss's: the ramp's ends left fractional
    ("yarn", {"factor": 32.0, "original_max_position_embeddings": 4096, "truncate": False},
     {"rope_scaling_factor": 32.0, "rope_original_max_seq_len": 4096, "rope_truncate": False}),
]


def small(**extra: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, d_ff=48,
                                max_seq_len=24, position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    return model_from_flat(**{**base, **extra})


@pytest.mark.parametrize("head_dim,theta", [(64, 500000.0), (16, 10000.0)])
@pytest.mark.parametrize("kind,hf_params,ours", SCALINGS)
def test_inverse_frequencies_and_yarn_scaling_equal_transformers(kind, hf_params, ours, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    original = hf_params.get("original_max_position_embeddings", 64)
    hf = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                     max_position_embeddings=int(original * hf_params["factor"]),
                     rope_parameters={"rope_type": kind, "rope_theta": theta, **hf_params})
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    cfg = small(d_model=4 * head_dim, rope_theta=theta, rope_scaling=kind, **ours)
    inv_freq, attention_factor = rope_frequencies(head_dim, theta, RopeScaling.from_config(cfg))
    torch.testing.assert_close(inv_freq.float(), hf_inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(hf_attention_factor, rel=1e-12)
    if kind != "linear":  # the scaling changes some frequencies and keeps others
        plain, _ = rope_frequencies(head_dim, theta)
        assert (inv_freq < plain * 0.999).any() and (inv_freq == plain).any()


def test_yarn_tables_carry_the_attention_factor_and_none_is_plain_rope():
    plain = RotaryEmbedding(16, 12, 10000.0)
    old = RotaryEmbedding(16, 12)  # the default stays plain RoPE
    torch.testing.assert_close(plain.cos, old.cos, rtol=0, atol=0)
    yarn = RotaryEmbedding(16, 12, 10000.0, RopeScaling("yarn", 4.0, original_max_len=8))
    radius = (yarn.cos**2 + yarn.sin**2).sqrt()
    torch.testing.assert_close(radius, torch.full_like(radius, 0.1 * torch.tensor(4.0).log().item() + 1.0))


def test_rope_tables_are_buffers_never_checkpointed():
    model = Transformer(small(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=8))
    assert not any("rope" in name for name in model.state_dict())


def test_explicit_head_dim_builds_trains_and_counts():
    cfg = small(d_model=24, n_heads=4, head_dim=10)  # 4 x 10 != 24
    torch.manual_seed(0)
    model = Transformer(cfg)
    attn = model.decoder_layers["0"].attn
    assert attn.q_proj.weight.shape == (40, 24) and attn.k_proj.weight.shape == (20, 24)
    assert attn.o_proj.weight.shape == (24, 40) and attn.scale == pytest.approx(10**-0.5)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]
    ids = torch.randint(0, 40, (2, 12))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0]


@pytest.mark.parametrize("extra", [dict(qk_norm=True), dict(qkv_bias=True), dict(bias=True, qkv_bias=False),
                                   dict(head_dim=6, qk_norm=True, qkv_bias=True)])
def test_params_counted_with_each_option(extra):
    for family in ("decoder", "encoder_decoder"):
        cfg = small(family=family, **extra)
        assert sum(p.numel() for p in Transformer(cfg).parameters()) == count_params(cfg)["total"]


def test_qkv_bias_on_queries_keys_values_only():
    attn = Transformer(small(qkv_bias=True)).decoder_layers["0"].attn
    assert attn.q_proj.bias.shape == (32,) and attn.k_proj.bias.shape == (16,) and attn.v_proj.bias.shape == (16,)
    assert attn.o_proj.bias is None
    biased = Transformer(small(bias=True, qkv_bias=False)).decoder_layers["0"].attn
    assert biased.q_proj.bias is None and biased.v_proj.bias is None and biased.o_proj.bias is not None
    follows = Transformer(small(bias=True)).decoder_layers["0"].attn
    assert follows.q_proj.bias is not None and follows.o_proj.bias is not None


def test_qk_norm_is_rmsnorm_per_head_before_rope():
    cfg = small(qk_norm=True, norm_eps=1e-6, rope_scaling="linear", rope_scaling_factor=2.0)
    torch.manual_seed(0)
    model = Transformer(cfg).to(F64)
    attn = model.decoder_layers["0"].attn
    assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.shape == (8,)
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5)
        attn.k_norm.weight.uniform_(0.5, 1.5)
        x = torch.randn(2, 5, 32, dtype=F64)
        rope = model.rope(torch.arange(5))
        attn.capture_weights = True
        attn(x, AttentionMask(None, is_causal=True), rope=rope)

        def rms_norm(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # Qwen3RMSNorm over each head
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

        q = attn.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
        k = attn.k_proj(x).view(2, 5, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        q, k = apply_rope(rms_norm(q, attn.q_norm.weight), rope), apply_rope(rms_norm(k, attn.k_norm.weight), rope)
        scores = (q @ k.transpose(-2, -1)) / 8**0.5
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(attn.weights, scores.softmax(-1), rtol=1e-12, atol=1e-12)


OPTIONS = [dict(head_dim=12), dict(qk_norm=True), dict(qkv_bias=True),
           dict(rope_scaling="linear", rope_scaling_factor=2.0),
           dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=8),
           dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=8),
           dict(head_dim=12, qk_norm=True, qkv_bias=True, rope_scaling="llama3", rope_scaling_factor=4.0,
                rope_original_max_seq_len=8),
           # Gemma's block options: each block's own mask (window or none) and RoPE tables at every cache offset
           dict(activation="geglu", norm_position="sandwich", norm_weight_offset=1.0, qk_norm=True,
                scale_embeddings=True, attention_window=3, full_attention_every=2, rope_theta=1e6,
                rope_local_theta=1e4, attention_softcap=2.0, logit_softcap=3.0),
           dict(norm_position="post_sublayer", qk_norm=True, qk_norm_scope="projection")]  # OLMo 2's


@pytest.mark.parametrize("family", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("extra", OPTIONS, ids=lambda e: "-".join(e))
def test_kv_cache_decoding_equals_full_forward(family, extra):
    torch.manual_seed(0)
    model = Transformer(small(family=family, **extra)).to(F64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
        ids = torch.randint(0, 40, (2, 9))
        memory = memory_padding = None
        if model.spec.seq2seq:
            memory_padding = torch.ones(2, 6, dtype=torch.bool)
            memory, memory_padding = model.encode(torch.randint(0, 40, (2, 6)), memory_padding)
        full = model.head(model.decode(ids, memory=memory, memory_padding=memory_padding))
        cache = model.new_cache()
        pieces = [model.head(model.decode(ids[:, :4], memory=memory, memory_padding=memory_padding, cache=cache))]
        for t in range(4, 9):
            pieces.append(model.head(model.decode(ids[:, t:t + 1], memory=memory, memory_padding=memory_padding,
                                                  cache=cache)))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-9, atol=1e-10)


def test_init_is_name_seeded_for_the_new_parameters():
    cfg = small(qk_norm=True, qkv_bias=True)
    a, b = Transformer(cfg, init_seed=7), Transformer(cfg, init_seed=7)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name
    attn = a.decoder_layers["1"].attn
    assert (attn.q_norm.weight == 1).all() and (attn.k_proj.bias == 0).all()


def config_with(**model: Any):
    raw = {"model": {"vocab_size": 64, "d_model": 32, "n_heads": 4, "position": "rope", "max_seq_len": 32, **model},
           "data": {"seq_len": 16}}
    return config_from_dict(raw)


@pytest.mark.parametrize("model,match", [
    (dict(head_dim=0), "model.attention.head_dim=0 must be positive"),
    (dict(head_dim=7), "RoPE needs an even head dimension, got 7"),
    (dict(d_model=30), "set model.attention.head_dim"),
    (dict(position="learned", rope_scaling="linear", rope_scaling_factor=2.0), "model.position='rope'"),
    (dict(rope_scaling="linear", rope_scaling_factor=0.5), "rope.factor=0.5 must be >= 1"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0), "needs model.rope.original_max_seq_len"),
    (dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_original_max_seq_len=8, rope_low_freq_factor=4.0),
     "need 0 < low < high"),
    (dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=8, rope_beta_slow=64.0),
     "need 0 < beta_slow <= beta_fast"),
    (dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_seq_len=8, rope_attention_factor=0.0),
     "rope.attention_factor=0.0 must be positive"),
])
def test_bad_options_get_one_line(model, match):
    with pytest.raises(ConfigError, match=match) as caught:
        config_with(**model)
    assert "\n" not in str(caught.value)


def test_head_dim_lifts_the_divisibility_rule():
    assert config_with(d_model=30, head_dim=8).model.attention_head_dim == 8


@pytest.mark.parametrize(("extra", "arch"), [(dict(head_dim=16), "llama"), (dict(qk_norm=True), "qwen3"),
                                             (dict(qkv_bias=True), "qwen2"),
                                             (dict(rope_scaling="linear", rope_scaling_factor=2.0), "llama")])
def test_each_option_exports_as_the_architecture_that_has_it(extra, arch):
    """Llama maps head_dim and rotary scaling; QK-norm is Qwen3's, Q/K/V-only biases Qwen2's (checkpointing/hf.py)."""
    from meshformer.checkpointing.hf import incompatibilities, infer_arch

    cfg = small(**extra)
    assert incompatibilities(small(), "llama") == []
    assert infer_arch(cfg) == arch
    assert (incompatibilities(cfg, "llama") == []) == (arch == "llama")
