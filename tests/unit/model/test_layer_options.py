"""Block options of Gemma and OLMo 2, as data in the model config: per-layer attention pattern (sliding window on some
blocks, global on others, each kind with its own RoPE base), post-sublayer and sandwich norms, RMSNorm by
(offset + weight), GeGLU, attention- and final-logit soft-capping, QK-norm over the whole projection. Transformers
parity for them is in test_model_references.py (OLMo 2, Gemma 2 / 3), the KV cache in test_attention_options.py;
here: the formulas, init, checks, counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshformer.config import ConfigError, ModelConfig, config_from_dict
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.masks import AttentionMask

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
GEMMA = dict(activation="geglu", norm_position="sandwich", norm_weight_offset=1.0, qk_norm=True,
             scale_embeddings=True, attention_window=3, full_attention_every=2, rope_theta=1e6, rope_local_theta=1e4,
             attention_softcap=2.0, logit_softcap=3.0)
OLMO2 = dict(norm_position="post_sublayer", qk_norm=True, qk_norm_scope="projection")


def small(**extra: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=4, d_ff=48,
                                max_seq_len=24, position="rope", norm="rmsnorm", activation="swiglu", bias=False)
    return model_from_flat(**{**base, **extra})


def test_attention_softcap_caps_the_scaled_scores_before_the_softmax():
    torch.manual_seed(0)
    model = Transformer(small(attention_softcap=0.5)).to(F64)
    attn = model.decoder_layers["0"].attn
    x = 10 * torch.randn(2, 5, 32, dtype=F64)
    with torch.no_grad():
        attn.capture_weights = True
        attn(x, AttentionMask(None, is_causal=True))
        q = attn.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
        k = attn.k_proj(x).view(2, 5, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        scores = 0.5 * torch.tanh((q @ k.transpose(-2, -1)) / 8**0.5 / 0.5)
        scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(attn.weights, scores.softmax(-1), rtol=1e-12, atol=1e-12)
    assert (q @ k.transpose(-2, -1)).abs().max() / 8**0.5 > 0.5  # the cap bends some scores


def test_logit_softcap_bounds_the_logits():
    torch.manual_seed(0)
    capped = Transformer(small(logit_softcap=0.5)).to(F64).eval()
    plain = Transformer(small()).to(F64).eval()
    plain.load_state_dict(capped.state_dict())
    ids = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        raw = plain(ids)
        torch.testing.assert_close(capped(ids), 0.5 * torch.tanh(raw / 0.5), rtol=1e-12, atol=1e-12)
    assert raw.abs().max() > 0.5


def test_window_pattern_gives_global_blocks_every_key_and_their_own_rope():
    cfg = small(attention_window=3, full_attention_every=2, rope_local_theta=1e4, rope_theta=1e6)
    assert [cfg.window(i) for i in range(4)] == [3, None, 3, None]
    assert [cfg.local_rope(i) for i in range(4)] == [True, False, True, False]
    model = Transformer(cfg)
    assert (model.rope.theta, model.local_rope.theta) == (1e6, 1e4)
    # one windowed block: the last token cannot see the first; add a global block and it can
    for n_layers, reaches in ((1, False), (2, True)):
        torch.manual_seed(0)
        one = Transformer(small(n_layers=n_layers, attention_window=3, full_attention_every=2)).to(F64)
        h = one.embed(torch.randint(0, 40, (1, 8))).detach().requires_grad_()
        one.decode(torch.zeros(1, 8, dtype=torch.long), h=h)[0, -1].sum().backward()
        assert (h.grad[0, 0].abs().sum() > 0) == reaches


def test_norms_sit_where_norm_position_says():
    torch.manual_seed(0)
    block = Transformer(small(**GEMMA, n_layers=1)).decoder_layers["0"]
    assert block.attn_out_norm is not None and block.ffn_out_norm is not None
    assert Transformer(small(**OLMO2)).decoder_layers["0"].attn_out_norm is None
    # post_sublayer: x + norm(f(x)); the attention reads x itself
    olmo = Transformer(small(**OLMO2, n_layers=1)).to(F64)
    block = olmo.decoder_layers["0"]
    x = torch.randn(1, 5, 32, dtype=F64)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
        mask = AttentionMask(None, is_causal=True)
        rope = olmo.rope(torch.arange(5))
        h = x + block.attn_norm(block.attn(x, mask, rope=rope))
        torch.testing.assert_close(block(x, mask, rope=rope), h + block.ffn_norm(block.ffn(h)))


def test_whole_projection_qk_norm_and_offset_init():
    olmo = Transformer(small(**OLMO2)).decoder_layers["0"].attn
    assert olmo.q_norm.weight.shape == (32,) and olmo.k_norm.weight.shape == (16,)
    gemma = Transformer(small(**GEMMA), init_seed=3)
    norms = [m for name, m in gemma.named_modules() if name.endswith("norm")]
    assert norms and all((m.weight == 0).all() for m in norms)  # (1 + 0): a unit scale, as Gemma initialises
    x = torch.randn(3, 32)
    torch.testing.assert_close(gemma.decoder_norm(x), torch.nn.functional.rms_norm(x, (32,), eps=1e-5))


def config_with(**model: Any):
    raw = {"model": {"vocab_size": 64, "d_model": 32, "n_heads": 4, "position": "rope", "norm": "rmsnorm",
                     "max_seq_len": 32, **model}, "data": {"seq_len": 16}}
    return config_from_dict(raw)


@pytest.mark.parametrize("model,match", [
    (dict(full_attention_every=2), "model.full_attention_every=2 .* needs model.attention.window .*; set both"),
    (dict(attention_window=4, full_attention_every=0), "a value >= 1"),
    (dict(rope_local_theta=1e4), "model.rope.local_theta=10000.0 .* needs .*sliding_attention blocks"),
    (dict(attention_softcap=0.0), "model.attention.softcap=0.0 must be positive"),
    (dict(logit_softcap=-1.0), "model.logit_softcap=-1.0 must be positive"),
    (dict(norm="layernorm", norm_weight_offset=1.0), "set model.norm.kind='rmsnorm'"),
    (dict(qk_norm_scope="projection"), "has no QK-norm to place; set model.attention.qk_norm=true"),
])
def test_bad_options_get_one_line(model, match):
    with pytest.raises(ConfigError, match=match) as caught:
        config_with(**model)
    assert "\n" not in caught.value.one_line()


def test_logit_softcap_trains_with_the_plain_loss_only():
    from meshformer.parallel_dims import ParallelDims
    from meshformer.train.loss_choice import resolve_loss

    dims = ParallelDims.from_config(config_with().parallel, 1)
    assert resolve_loss(config_with(logit_softcap=30.0), dims, "cpu").method == "plain"
    assert resolve_loss(config_with(), dims, "cpu").method == "chunked"
    cfg = config_with(logit_softcap=30.0)
    cfg.train.loss = "chunked"
    with pytest.raises(ConfigError, match="without model.logit_softcap=30.0; use train.loss='plain'"):
        resolve_loss(cfg, dims, "cpu")


def test_planner_counts_the_sandwich_norms_and_the_capped_scores():
    from meshformer.planner.activations import FP32, ActivationShape, block_saved

    x = ActivationShape(batch=2, seq=16, tp=1, bytes=4, residual_bytes=4)
    pre = block_saved(small(), x)
    norm = 2 * 16 * (2 * 32 + 1) * FP32  # one RMSNorm's saved input and statistics
    assert block_saved(small(norm_position="sandwich"), x) == pre + 2 * norm
    math = block_saved(small(attention_backend="math"), x)
    scores = 2 * 4 * 16 * 16  # batch x heads x queries x keys
    assert block_saved(small(attention_softcap=50.0), x) == math + scores * 4  # the tanh of the capped scores
