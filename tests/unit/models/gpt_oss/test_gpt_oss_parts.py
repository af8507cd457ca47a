"""gpt-oss's model pieces against transformers' own gpt_oss modules with copied weights, in fp32: attention sinks
on every backend that takes them (padded and sliding-window masks, a KV cache, gradients), the clamped SwiGLU in
the dense feed-forward and in biased experts on every CPU MoE backend with the biased router, YaRN without
truncation; their parameter counts, initialisation and optimizer groups."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from meshformer.checkpointing import ConversionError
from meshformer.checkpointing.hf_folder import export_hf
from meshformer.checkpointing.megatron_config import megatron_incompatibilities
from meshformer.config import ConfigError, OptimConfig, config_from_dict
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.attention import Attention, KVCache
from meshformer.model.blockwise_attention import blockwise_attention
from meshformer.model.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig, NormConfig
from meshformer.model.flops import count_params
from meshformer.model.layers import FeedForward
from meshformer.model.masks import build_mask
from meshformer.model.moe import MoEFeedForward, grouped_mm_runs, route
from meshformer.model.positions import RopeScaling, RotaryEmbedding, rope_frequencies
from meshformer.optim import build_optimizer
from meshformer.optim.muon import is_muon_parameter

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss as hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, WIDTH = 32, 4, 2, 8, 4, 2, 16


def hf_config(**extra: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=40, hidden_size=D, intermediate_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        sliding_window=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    config = transformers.GptOssConfig(**{**fields, **extra})
    config._attn_implementation = "eager"
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    return config


def ours(**extra: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        vocab_size=40, d_model=D, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, n_layers=2, d_ff=WIDTH,
        max_seq_len=64, position="rope", norm="rmsnorm", activation="swiglu_clamped", bias=True,
        attention_sinks=True, rope_theta=150000.0, rope_scaling="yarn", rope_scaling_factor=32.0,
        rope_original_max_seq_len=4096, rope_truncate=False, n_experts=EXPERTS, experts_per_token=TOP_K,
        router_bias=True, expert_bias_terms=True)
    return model_from_flat(**{**base, **extra})


def random_(*params: torch.Tensor, std: float = 0.3) -> None:
    with torch.no_grad():
        for p in params:
            p.normal_(std=std)


# ---------------------------------------------------------------------------------------------------- attention


def attention_pair(backend: str, seed: int = 0) -> tuple[Any, Attention]:
    torch.manual_seed(seed)
    theirs = hf.GptOssAttention(hf_config(), layer_idx=0).eval()
    random_(*theirs.parameters())
    with torch.no_grad():
        theirs.sinks.mul_(5)  # sinks that matter: some heads give the keys little weight
    mine = Attention(ours(attention_backend=backend), causal=True).eval()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(mine, name).weight.copy_(getattr(theirs, name).weight)
            getattr(mine, name).bias.copy_(getattr(theirs, name).bias)
        assert mine.sinks is not None
        mine.sinks.weight.copy_(theirs.sinks)
    return theirs, mine


def hf_rope(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = hf.GptOssRotaryEmbedding(hf_config())
    return rotary(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])


ATTENTION_BACKENDS = ["auto", "math", "blockwise", "sdpa", "flash", "efficient", "cudnn"]


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("layout", ["causal", "padded", "window"])
def test_attention_sinks_equal_transformers(backend, layout):
    theirs, mine = attention_pair(backend)
    batch, length = 2, 12
    x = torch.randn(batch, length, D)
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[1, 9:] = False  # right padding: every query row keeps a real key
    mask = build_mask(length, length, causal=True, key_padding=padding if layout == "padded" else None,
                      window=4 if layout == "window" else None)
    allowed = mask.materialize(length, length, x.device)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    cos, sin = hf_rope(length)
    expected, _ = theirs(x, position_embeddings=(cos, sin), attention_mask=additive)
    # the same rotation (the tables are compared in the YaRN test): ours repeat each frequency for both halves
    rope = torch.cat([cos[0], cos[0]], -1), torch.cat([sin[0], sin[0]], -1)
    torch.testing.assert_close(mine(x, mask, rope=rope), expected, rtol=1e-5, atol=1e-6)


def test_sinks_change_attention_and_a_cache_step_equals_the_whole_sequence():
    _, mine = attention_pair("auto")
    x = torch.randn(1, 8, D)
    rope_all = RotaryEmbedding(HEAD_DIM, 64)(torch.arange(8))
    whole = mine(x, build_mask(8, 8, causal=True), rope=rope_all)
    cache = KVCache()
    mine(x[:, :7], build_mask(7, 7, causal=True), rope=(rope_all[0][:7], rope_all[1][:7]), cache=cache)
    step = mine(x[:, 7:], build_mask(1, 8, q_offset=7, causal=True), rope=(rope_all[0][7:], rope_all[1][7:]),
                cache=cache)
    torch.testing.assert_close(step, whole[:, 7:], rtol=1e-5, atol=1e-6)
    assert mine.sinks is not None
    with torch.no_grad():
        mine.sinks.weight.fill_(-1e4)  # a vanishing sink: plain softmax attention
    plain = Attention(ours(attention_sinks=False), causal=True).eval()
    plain.load_state_dict({k: v for k, v in mine.state_dict().items() if "sinks" not in k})
    mask = build_mask(8, 8, causal=True)
    torch.testing.assert_close(mine(x, mask, rope=rope_all), plain(x, mask, rope=rope_all), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(whole, plain(x, mask, rope=rope_all), atol=1e-3)


@pytest.mark.parametrize("q_len,k_len,causal", [(12, 12, True), (5, 12, True), (7, 9, False), (130, 130, True)])
def test_blockwise_sinks_forward_and_gradients_equal_the_explicit_softmax(q_len, k_len, causal):
    """The blockwise kernel (its sink in the running denominator, its own backward) against autograd through the
    explicit softmax with the sink as an extra column, in fp64; 130 queries span several query blocks."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, q_len, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, k_len, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, k_len, 8, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(3, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, q_len, 8, dtype=torch.float64)
    out = blockwise_attention(q, k, v, scale=0.35, causal=causal, sinks=sinks)
    got = torch.autograd.grad(out, (q, k, v, sinks), grad)
    scores = q @ k.transpose(-2, -1) * 0.35
    if causal:
        scores = scores.masked_fill(~torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len), float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(2, -1, q_len, 1)
    reference = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v
    expected = torch.autograd.grad(reference, (q, k, v, sinks), grad)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_attention_gradients_equal_on_every_backend(padded):
    """Blockwise (its own backward) and SDPA (the sink as a key) against the explicit softmax."""
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[0, 7:] = not padded
    mask = build_mask(10, 10, causal=True, key_padding=padding if padded else None)
    grads = {}
    for backend in ATTENTION_BACKENDS:
        _, mine = attention_pair(backend)
        x = torch.randn(2, 10, D, generator=torch.Generator().manual_seed(3))
        mine(x, mask, rope=RotaryEmbedding(HEAD_DIM, 64)(torch.arange(10))).square().sum().backward()
        grads[backend] = {n: p.grad for n, p in mine.named_parameters()}
    assert grads["math"]["sinks.weight"].abs().sum() > 0
    for backend in ATTENTION_BACKENDS[1:]:
        for name, g in grads["math"].items():  # fp32 sums of different order: 1e-6 of the largest entry
            torch.testing.assert_close(grads[backend][name], g, rtol=1e-5, atol=1e-6 * g.abs().max().item())


@pytest.mark.parametrize("head_dim", [8, 12])
@pytest.mark.parametrize("bias", [False, True], ids=["mask", "bias"])
def test_sink_as_key_equals_the_sink_in_the_softmax(head_dim, bias):
    """The SDPA form: a cache step (fewer queries than keys, causal at the bottom right), a padded mask, an
    additive position bias, a head width that is and one that is not a multiple of 8."""
    from meshformer.model.attention import sink_as_key, with_sinks

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, head_dim), torch.randn(2, 4, 7, head_dim), torch.randn(2, 4, 7, head_dim)
    sinks = torch.randn(4)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, :2] = False
    mask = build_mask(3, 7, q_offset=4, causal=True, key_padding=padding)
    additive = torch.randn(4, 3, 7) if bias else None
    scores = q @ k.transpose(-2, -1) * 0.3 + (0 if additive is None else additive)
    scores = scores.masked_fill(~mask.mask, torch.finfo(torch.float32).min)
    expected = with_sinks(scores, sinks) @ v
    q2, k2, v2, mask2, bias2 = sink_as_key(q, k, v, mask, additive, sinks, 0.3)
    assert q2.shape[-1] % 8 == 0 and k2.shape[2] == 8
    attn_mask = mask2.mask if bias2 is None else \
        bias2[None].masked_fill(~mask2.mask, torch.finfo(torch.float32).min)  # type: ignore[union-attr]
    out = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=attn_mask, scale=0.3)
    torch.testing.assert_close(out[..., :head_dim], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- feed-forward


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's gate_up columns interleave gate (even) and up (odd)."""
    return fused[..., ::2], fused[..., 1::2]


def test_dense_clamped_swiglu_equals_transformers_unit():
    torch.manual_seed(0)
    experts = hf.GptOssExperts(hf_config(num_local_experts=1))
    random_(*experts.parameters(), std=1.0)
    mine = FeedForward(ours(n_experts=0, router_bias=False, expert_bias_terms=False))
    with torch.no_grad():
        gate, up = split_gate_up(experts.gate_up_proj[0])
        gate_bias, up_bias = split_gate_up(experts.gate_up_proj_bias[0])
        mine.gate_proj.weight.copy_(gate.T)  # type: ignore[union-attr]
        mine.gate_proj.bias.copy_(gate_bias)  # type: ignore[union-attr]
        mine.up_proj.weight.copy_(up.T)
        mine.up_proj.bias.copy_(up_bias)
        mine.down_proj.weight.copy_(experts.down_proj[0].T)
        mine.down_proj.bias.copy_(experts.down_proj_bias[0])
    x = torch.randn(20, D) * 2
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > 7.0).any()  # the clamps are exercised
    expected = experts._apply_gate(gate_up) @ experts.down_proj[0] + experts.down_proj_bias[0]
    torch.testing.assert_close(mine(x), expected, rtol=1e-5, atol=1e-5)


def test_routing_softmax_renormalised_equals_softmax_over_the_top_k():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3
    routing = route(logits, 3)
    top, indices = logits.topk(3, dim=-1)
    assert torch.equal(routing.experts, indices)
    torch.testing.assert_close(routing.weights, torch.softmax(top, dim=-1), rtol=1e-6, atol=1e-7)


BACKENDS = ["loop", "padded", *(["grouped_mm"] if grouped_mm_runs("cpu") else [])]


def moe_pair(backend: str) -> tuple[Any, MoEFeedForward]:
    torch.manual_seed(0)
    theirs = hf.GptOssMLP(hf_config())
    random_(*theirs.parameters(), std=0.5)
    mine = MoEFeedForward(ours(moe_backend=backend))
    with torch.no_grad():
        mine.router.weight.copy_(theirs.router.weight)
        mine.router.bias.copy_(theirs.router.bias)  # type: ignore[union-attr]
        experts = mine.experts
        gate, up = split_gate_up(theirs.experts.gate_up_proj)
        gate_bias, up_bias = split_gate_up(theirs.experts.gate_up_proj_bias)
        for param, value in ((experts.gate_proj, gate), (experts.up_proj, up), (experts.gate_bias, gate_bias),
                             (experts.up_bias, up_bias), (experts.down_proj, theirs.experts.down_proj),
                             (experts.down_bias, theirs.experts.down_proj_bias)):
            assert param is not None
            param.copy_(value)
    return theirs, mine


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_with_biases_and_clamped_swiglu_equals_transformers(backend):
    theirs, mine = moe_pair(backend)
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1)) * 2
    expected, _ = theirs(x)
    torch.testing.assert_close(mine(x), expected, rtol=1e-5, atol=1e-5)


def test_moe_backends_give_the_same_gradients_with_biases():
    grads = {}
    for backend in BACKENDS:
        _, mine = moe_pair(backend)
        x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
        mine(x).square().sum().backward()
        grads[backend] = {n: p.grad for n, p in mine.named_parameters()} | {"x": x.grad}
    assert grads["loop"]["experts.down_bias"].abs().sum() > 0 and grads["loop"]["router.bias"].abs().sum() > 0
    for backend in BACKENDS[1:]:
        for name, g in grads["loop"].items():
            torch.testing.assert_close(grads[backend][name], g, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- YaRN


def test_yarn_without_truncation_equals_gpt_oss_rotary_tables():
    rotary = hf.GptOssRotaryEmbedding(hf_config())
    cfg = ours()
    inv_freq, attention_factor = rope_frequencies(HEAD_DIM, cfg.rope.theta, RopeScaling.from_config(cfg))
    torch.testing.assert_close(inv_freq.float(), rotary.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    cos, sin = rotary(torch.zeros(1), torch.arange(64)[None])
    table = RotaryEmbedding(HEAD_DIM, 64, cfg.rope.theta, RopeScaling.from_config(cfg))
    half = HEAD_DIM // 2  # HF's gpt-oss tables hold each frequency once; ours repeat them for both halves
    torch.testing.assert_close(table.cos[:, :half], cos[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(table.sin[:, half:], sin[0], rtol=1e-5, atol=1e-6)
    truncated, _ = rope_frequencies(64, cfg.rope.theta, RopeScaling.from_config(
        dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, truncate=True))))
    exact, _ = rope_frequencies(64, cfg.rope.theta, RopeScaling.from_config(cfg))
    assert not torch.allclose(truncated, exact)  # the key changes the function


# ---------------------------------------------------------------------------------------------------- bookkeeping


def test_parameter_count_init_and_optimizer_groups():
    cfg = ours(n_layers=2)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)["total"]
    params = dict(model.named_parameters())
    sinks = params["decoder_layers.0.attn.sinks.weight"]
    assert sinks.shape == (HEADS,) and sinks.abs().sum() > 0  # drawn like the other weights (normal, init_std)
    for name in ("experts.gate_bias", "experts.up_bias", "experts.down_bias", "router.bias"):
        assert params[f"decoder_layers.0.ffn.{name}"].abs().sum() == 0
    xavier = dict(Transformer(ours(init="xavier")).named_parameters())["decoder_layers.0.attn.sinks.weight"]
    assert 0 < xavier.abs().max() < 0.2  # a vector: normal(init_std) under Xavier too
    optimizer, _ = build_optimizer([model], OptimConfig(weight_decay=0.1))
    no_decay = {id(p) for g in optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    for name in ("attn.sinks.weight", "ffn.experts.gate_bias", "ffn.experts.down_bias", "ffn.router.bias"):
        assert id(params[f"decoder_layers.0.{name}"]) in no_decay, name
    assert id(params["decoder_layers.0.ffn.experts.up_proj"]) not in no_decay
    assert not is_muon_parameter("decoder_layers.0.ffn.experts.up_bias", params["decoder_layers.0.ffn.experts.up_bias"])
    assert is_muon_parameter("decoder_layers.0.ffn.experts.up_proj", params["decoder_layers.0.ffn.experts.up_proj"])


@pytest.mark.parametrize("model,named", [
    (dict(router_bias=True), "model.moe.router_bias=true needs experts"),
    (dict(expert_bias_terms=True), "model.moe.expert_linear_bias=true needs experts"),
    (dict(activation="swiglu_clamped", swiglu_limit=0.0), "model.ffn.swiglu_limit=0.0"),
])
def test_refusals(model, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        config_from_dict({"model": model})


@pytest.mark.parametrize("key,named", [("attention_sinks", "attention_sinks"), ("router_bias", "router_bias"),
                                       ("expert_bias_terms", "expert_linear_bias")])  # flat keys; the piece's name
def test_exports_that_would_drop_a_gpt_oss_piece_are_refused(key, named, tmp_path):
    cfg = model_from_flat(vocab_size=64, d_model=32, n_heads=4, n_layers=1, d_ff=32, activation="swiglu",
                          norm="rmsnorm", position="rope", bias=False, max_seq_len=16,
                          n_experts=0 if key == "attention_sinks" else 4, **{key: True})
    with pytest.raises(ConversionError, match=f"{named}=True"):
        export_hf(Transformer(cfg).state_dict(), cfg, tmp_path / "hf", "mixtral" if cfg.moe.n_experts else "llama")
    assert any(named in problem for problem in megatron_incompatibilities(cfg))


@pytest.mark.parametrize("layers,experts,total", [(24, 32, 20_914_757_184), (36, 128, 116_829_156_672)],
                         ids=["gpt-oss-20b", "gpt-oss-120b"])
def test_parameter_counts_of_the_published_shapes_equal_transformers(layers, experts, total):
    """The issue's 20.9B / 116.8B: `meshformer params` of gpt-oss-20b / 120b's shapes, and transformers' model of
    the same config (built on the meta device) holding as many parameters."""
    cfg = ModelConfig(vocab_size=201088, d_model=2880, n_layers=layers, bias=True, position="rope",
                      tie_embeddings=False,
                      attention=AttentionConfig(n_heads=64, n_kv_heads=8, head_dim=64, sinks=True),
                      ffn=FfnConfig(d_ff=2880, activation="swiglu_clamped"), norm=NormConfig(kind="rmsnorm"),
                      moe=MoeConfig(n_experts=experts, experts_per_token=4, router_bias=True, expert_linear_bias=True))
    assert count_params(cfg)["total"] == total
    config = transformers.GptOssConfig(num_hidden_layers=layers, num_local_experts=experts)
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == total


@pytest.mark.parametrize("window", [False, True], ids=["full", "sliding"])
def test_decoder_block_equals_transformers_layer(window):
    """One whole block (RMSNorms, attention with sinks, biased MoE with the clamped SwiGLU, residuals), padded."""
    from meshformer.model.layers import TransformerBlock

    theirs_attention, _ = attention_pair("auto")
    theirs_moe, mine_moe = moe_pair("auto")
    theirs = hf.GptOssDecoderLayer(hf_config(), layer_idx=0).eval()
    theirs.self_attn.load_state_dict(theirs_attention.state_dict())
    random_(theirs.input_layernorm.weight, theirs.post_attention_layernorm.weight)
    cfg = ours(attention_window=4 if window else None)
    mine = TransformerBlock(cfg, causal=True).eval()  # every block MoE (model.moe.n_experts, no mlp_types)
    with torch.no_grad():
        theirs.mlp.load_state_dict(theirs_moe.state_dict())
        mine.ffn.load_state_dict(mine_moe.state_dict())
        mine.attn_norm.weight.copy_(theirs.input_layernorm.weight)
        mine.ffn_norm.weight.copy_(theirs.post_attention_layernorm.weight)
        for name, value in theirs.self_attn.named_parameters():
            dict(mine.attn.named_parameters())["sinks.weight" if name == "sinks" else name].copy_(value)
    length = 10
    x = torch.randn(2, length, D, generator=torch.Generator().manual_seed(2))
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[1, 8:] = False
    mask = build_mask(length, length, causal=True, key_padding=padding, window=4 if window else None)
    additive = torch.zeros(mask.mask.shape).masked_fill(~mask.mask, torch.finfo(torch.float32).min)  # type: ignore
    cos, sin = hf_rope(length)
    expected = theirs(x, attention_mask=additive, position_embeddings=(cos, sin))
    got = mine(x, mask, rope=(torch.cat([cos[0], cos[0]], -1), torch.cat([sin[0], sin[0]], -1)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
