"""Gated DeltaNet (meshformer/model/linear_attention.py) against transformers' Qwen3NextGatedDeltaNet with copied
weights, in fp32: a padded batch, grouped value heads, a cached prefill then decoding steps; packed documents equal
the documents run one by one (state and convolution window restart); gradients flow to every parameter."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.recurrent_mixer import (
    assert_cached_steps_match_transformers,
    assert_context_parallel_pieces_equal_the_whole,
    assert_gradients_reach_every_parameter,
    assert_matches_transformers_on_a_padded_batch,
    assert_packed_documents_equal_one_by_one,
)

from meshformer.config.migrate import model_from_flat
from meshformer.model.config import LinearAttentionConfig, ModelConfig
from meshformer.model.linear_attention import GatedDeltaNet

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

D = 32


def hf_config(**extra: Any) -> Any:
    fields: dict[str, Any] = dict(
        vocab_size=40, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, num_experts=0, layer_types=["linear_attention"] * 2)
    return transformers.Qwen3NextConfig(**{**fields, **extra})


def ours(chunk_size: int = 4, **extra: Any) -> ModelConfig:
    return model_from_flat(d_model=D, norm="rmsnorm", norm_eps=1e-6, norm_weight_offset=1.0, bias=False,
                           layer_types=["linear_attention"],
                           linear_attention=LinearAttentionConfig(n_heads=4, n_key_heads=2, key_head_dim=8,
                                                                  value_head_dim=6, conv_width=4,
                                                                  chunk_size=chunk_size), **extra)


def pair(chunk_size: int = 4, seed: int = 0) -> tuple[GatedDeltaNet, Any]:
    torch.manual_seed(seed)
    theirs = hf.Qwen3NextGatedDeltaNet(hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # every weight away from its init (the norm's ones, dt_bias's ones too)
            p.add_(torch.randn_like(p) * 0.3)
    mine = GatedDeltaNet(ours(chunk_size))
    missing = mine.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    return mine.eval(), theirs


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_matches_transformers_on_a_padded_batch(chunk_size: int) -> None:
    mine, theirs = pair(chunk_size)
    assert_matches_transformers_on_a_padded_batch(mine, theirs, D)


def test_cached_prefill_and_steps_match_transformers_cache() -> None:
    mine, theirs = pair()
    cache_hf = transformers.DynamicCache(config=hf_config())
    ours_cache = assert_cached_steps_match_transformers(mine, theirs, cache_hf, D)
    assert ours_cache.state.shape == (2, 4, 8, 6) and ours_cache.conv.shape == (2, 3, 2 * 16 + 24)


def test_packed_documents_equal_the_documents_one_by_one() -> None:
    assert_packed_documents_equal_one_by_one(pair(chunk_size=4)[0], D)


@pytest.mark.parametrize("lengths", [[7, 1, 5, 3], [2, 2], [16]])
def test_context_parallel_pieces_in_sequence_order_equal_the_whole_sequence(lengths: list[int]) -> None:
    """One rank holding both pieces (cp's layout at count 1: the gather is the identity): the first piece's state
    and convolution window enter the second, except where the second starts a document (lengths [7, 1, ...]:
    token 8 does); pieces of 2 tokens are shorter than the window of 3 earlier inputs."""
    assert_context_parallel_pieces_equal_the_whole(pair(chunk_size=4)[0], lengths, D)


def test_gradients_reach_every_parameter() -> None:
    assert_gradients_reach_every_parameter(pair()[0], D)


def test_the_rule_computes_in_float32_under_autocast() -> None:
    """Under bf16 autocast (bf16 training) the block runs forward and backward, and the delta rule inside it gives
    exactly its float32 result: autocast neither lowers its products nor breaks its preallocated scan."""
    from meshformer.model.gated_delta import chunk_gated_delta_rule

    mine, _ = pair()
    mine.train()
    x = torch.randn(2, 9, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mine(x)
    out.float().square().sum().backward()
    assert out.dtype == torch.bfloat16 and all(p.grad is not None for p in mine.parameters())
    torch.testing.assert_close(out.float(), mine(x), atol=0.1, rtol=0.05)
    q, k = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    v, g, beta = torch.randn(2, 9, 4, 6), -torch.rand(2, 9, 4), torch.rand(2, 9, 4)
    expected, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, use_qk_l2norm=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, use_qk_l2norm=True)
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def hybrid(**extra: Any) -> ModelConfig:
    cfg = ours(chunk_size=4, vocab_size=50, n_layers=3, n_heads=4, head_dim=8, position="rope", d_ff=48,
               activation="swiglu", qk_norm=True, document_mask=True, **extra)
    cfg.layer_types = ["linear_attention", "linear_attention", "full_attention"]
    return cfg


def test_a_packed_hybrid_model_equals_its_documents_one_by_one() -> None:
    """Through the whole model: attention stays within each document (document_mask) and so do the linear blocks'
    states and convolution windows."""
    from meshformer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(hybrid()).eval()
    lengths = [6, 2, 9]
    ids = torch.randint(0, 50, (1, sum(lengths)))
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = model(ids, doc_ids=documents)
        alone = torch.cat([model(part) for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_initialisation_follows_transformers_rules() -> None:
    """A_log = log(uniform(0.01, 16)), dt_bias 1, the gated norm's scale 1 even with (1 + weight) RMSNorms elsewhere
    (their weights start at 0), the convolution and projections normal."""
    from meshformer.model import Transformer

    model = Transformer(hybrid(), init_seed=3)
    mixer = model.decoder_layers["0"].attn
    assert isinstance(mixer, GatedDeltaNet) and model.decoder_layers["0"].mixers["attn"] == "linear_attention"
    assert torch.equal(mixer.dt_bias, torch.ones(4)) and torch.equal(mixer.norm.weight, torch.ones(6))
    decay = mixer.A_log.exp()
    assert decay.min() >= 0.01 and decay.max() <= 16 and decay.std() > 0
    assert torch.equal(model.decoder_layers["0"].attn_norm.weight, torch.zeros(D))
    assert mixer.conv1d.weight.std() > 0 and mixer.in_proj_qkvz.weight.std() > 0
    again = Transformer(hybrid(), init_seed=3)
    assert torch.equal(again.decoder_layers["0"].attn.A_log, mixer.A_log)  # from the seed and name alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "key_heads", "key_dim", "value_dim", "chunk", "batch", "seq"), [
    (4, 2, 16, 24, 8, 1, 50), (8, 4, 32, 32, 64, 2, 256), (4, 2, 64, 96, 32, 1, 300)])
def test_planner_bytes_follow_what_autograd_keeps(dtype, heads, key_heads, key_dim, value_dim, chunk, batch,
                                                  seq) -> None:
    """The kind's saved_bytes against the tensors the module's graph keeps (saved-tensor hooks, parameters
    excluded), in float32 and under bf16 autocast: within 12% (which tensors share storage with views varies with
    the shapes)."""
    from meshformer.model.components import TOKEN_MIXERS
    from meshformer.planner.activations import ActivationShape
    from meshformer.planner.measure import saved_activation_bytes

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, layer_types=["linear_attention"],
                      linear_attention=LinearAttentionConfig(n_heads=heads, n_key_heads=key_heads,
                                                             key_head_dim=key_dim, value_head_dim=value_dim,
                                                             chunk_size=chunk))
    module = GatedDeltaNet(cfg)
    x = torch.randn(batch, seq, cfg.d_model).to(dtype).requires_grad_()
    half = dtype != torch.float32
    with torch.autocast("cpu", torch.bfloat16, enabled=half):
        kept = saved_activation_bytes(module, lambda: module(x))
    layout = ActivationShape(batch, seq, 1, 2 if half else 4, 4)
    predicted = TOKEN_MIXERS["linear_attention"].saved_bytes(cfg, layout, memory_len=0, causal=True)
    assert abs(predicted / kept - 1) < 0.12, (predicted, kept)


def test_split_projections_match_transformers_qwen3_5_module() -> None:
    """projections = "split" holds Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a and computes what its
    Qwen3_5GatedDeltaNet does on a padded batch."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf35

    fields = {k: v for k, v in hf_config().to_dict().items() if k.startswith(("linear_", "hidden_size", "rms"))}
    torch.manual_seed(0)
    theirs = hf35.Qwen3_5GatedDeltaNet(transformers.Qwen3_5TextConfig(**fields), layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    cfg = ours(3)
    cfg.linear_attention.projections = "split"
    mine = GatedDeltaNet(cfg).eval()
    mine.load_state_dict(theirs.state_dict(), strict=True)
    assert_matches_transformers_on_a_padded_batch(mine, theirs, D)


def test_head_channels_pick_each_ranks_q_k_and_v() -> None:
    """Under tensor parallel a rank convolves its key heads' q and k channels and its value heads' v channels of
    the [all q | all k | all v] order (2 key heads of width 2, 4 value heads of width 1, 2 ranks)."""
    from meshformer.model.linear_attention import head_channels

    assert head_channels(2, 2, 4, 1, 2, 0).tolist() == [0, 1, 4, 5, 8, 9]
    assert head_channels(2, 2, 4, 1, 2, 1).tolist() == [2, 3, 6, 7, 10, 11]
    whole = torch.cat([head_channels(2, 8, 4, 6, 2, r) for r in range(2)])
    assert sorted(whole.tolist()) == list(range(2 * 16 + 24))  # every channel once


# OLMo hybrid's names -> the separate layout's (the conv, A_log, dt_bias keep theirs)
OLMO_HYBRID_NAMES = {"q_proj": "in_proj_q", "k_proj": "in_proj_k", "v_proj": "in_proj_v", "g_proj": "in_proj_z",
                     "b_proj": "in_proj_b", "a_proj": "in_proj_a", "o_proj": "out_proj", "o_norm": "norm"}


@pytest.mark.parametrize("allow_neg_eigval", [True, False])
def test_separate_projections_match_transformers_olmo_hybrid_module(allow_neg_eigval: bool) -> None:
    """projections = "separate" holds OLMo hybrid's q/k/v/g/b/a projections, allow_neg_eigval doubles beta and
    norm_eps sets the gated norm's epsilon: the same output as its OlmoHybridGatedDeltaNet on a padded batch, and
    a different one with allow_neg_eigval flipped (so the option is read)."""
    from transformers.models.olmo_hybrid import modeling_olmo_hybrid as hfo

    fields = {k: v for k, v in hf_config().to_dict().items() if k.startswith(("linear_", "hidden_size", "rms"))}
    torch.manual_seed(0)
    theirs = hfo.OlmoHybridGatedDeltaNet(
        transformers.OlmoHybridConfig(**fields, num_attention_heads=4, linear_allow_neg_eigval=allow_neg_eigval),
        layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    state = {}
    for key, value in theirs.state_dict().items():
        head, _, rest = key.partition(".")
        state[f"{OLMO_HYBRID_NAMES.get(head, head)}.{rest}" if rest else key] = value
    taps = state.pop("conv1d.weight").split([16, 16, 24])  # its q, k, v channels; ours keep them apart
    state.update({f"{p}_conv1d.weight": t for p, t in zip("qkv", taps, strict=True)})

    def run(neg: bool) -> torch.Tensor:
        cfg = ours(3)
        cfg.linear_attention.projections = "separate"
        cfg.linear_attention.allow_neg_eigval = neg
        cfg.linear_attention.norm_eps = 1e-5
        mine = GatedDeltaNet(cfg).eval()
        mine.load_state_dict(state, strict=True)
        with torch.no_grad():
            return mine(x, padding=padding)

    x = torch.randn(3, 11, D)
    padding = torch.ones(3, 11, dtype=torch.bool)
    padding[1, :4] = False
    padding[2, 7:] = False
    with torch.no_grad():
        expected = theirs(x, attention_mask=padding.long())
    real = padding[..., None].expand_as(expected)
    assert expected[real].std() > 0.01
    torch.testing.assert_close(run(allow_neg_eigval)[real], expected[real], atol=1e-5, rtol=1e-5)
    assert (run(not allow_neg_eigval)[real] - expected[real]).abs().max() > 1e-3
