"""OLMo hybrid (meshformer/models/olmo_hybrid/) against transformers' OlmoHybridForCausalLM, random-initialised: logits
on a padded fp32 batch both ways (with RoPE and without, as published), state dicts round trip bitwise, greedy
generation equal to transformers' with and without our cache, the bundled config's parameter count equal to
transformers' meta-device model, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch
from torch import nn

from meshformer.checkpointing.hf import config_from_hf, config_to_hf, from_hf_model, infer_arch
from meshformer.model import Transformer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97


def _hf_olmo_hybrid(**extra: Any) -> nn.Module:
    """GDN, GDN, attention, GDN: 2 key heads serving 4 value heads, negative eigenvalues allowed; every weight
    perturbed away from its init. The value width equals the key width: transformers' revert_weight_conversion
    (what from_hf_model reads) splits the concatenated convolution into three equal parts, whatever the widths."""
    torch.manual_seed(0)
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    hf = transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**{**fields, **extra}))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return hf.eval()


@pytest.mark.parametrize("rope", [True, False])
def test_logits_both_ways_and_bitwise_round_trips(rope: bool):
    hf = _hf_olmo_hybrid(**({} if rope else {"rope_parameters": {"rope_type": "default", "rope_theta": None}}))
    assert (hf.model.rotary_emb is None) != rope
    ours = from_hf_model(hf).eval()
    cfg = ours.cfg
    assert cfg.position == ("rope" if rope else "none") and infer_arch(cfg) == "olmo_hybrid"
    assert [cfg.block_norm_position(i) for i in range(4)] == ["pre", "pre", "post_sublayer", "pre"]
    assert cfg.linear_attention.projections == "separate" and cfg.linear_attention.allow_neg_eigval
    ids, mask = padded_batch(VOCAB)
    assert_import_exact(hf, ours, ids, mask)
    mine = Transformer(cfg).eval()
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert_export_exact(mine, ids, mask)


def test_greedy_generation_equals_transformers():
    """Left-padded prompts of 3, 9 and 6 tokens: our greedy decoding, with and without the cache, equals
    transformers' generate(do_sample=False)."""
    from meshformer.model.generate import greedy_decode, pad_rows

    theirs = _hf_olmo_hybrid()
    ours = from_hf_model(theirs).eval()
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    ids, padding = pad_rows(rows, pad_id=0)
    new = 6
    expected = theirs.generate(input_ids=ids, attention_mask=padding.long(), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0)
    for use_cache in (True, False):
        out = greedy_decode(ours, ids, new, prompt_padding=padding, use_cache=use_cache)
        assert out[:, ids.shape[1]:].tolist() == expected[:, ids.shape[1]:].tolist(), use_cache
    assert len({tuple(row) for row in out[:, ids.shape[1]:].tolist()}) == 3


@pytest.mark.parametrize(("extra", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=f"olmo_hybrid: {named}"):
        config_from_hf(transformers.OlmoHybridConfig(
            hidden_size=32, num_attention_heads=4, num_hidden_layers=4, intermediate_size=48, **extra))


def test_export_refuses_what_it_lacks():
    from meshformer.checkpointing.hf import check_compatible

    cfg = config_from_hf(_hf_olmo_hybrid().config)
    check_compatible(cfg, "olmo_hybrid")
    cfg.norm.by_kind = {}
    with pytest.raises(ValueError, match="norm_by_kind"):
        check_compatible(cfg, "olmo_hybrid")
    cfg = config_from_hf(_hf_olmo_hybrid().config)
    with pytest.raises(ValueError, match="norm_by_kind|linear_allow_neg_eigval|linear_norm_eps"):
        check_compatible(cfg, "qwen3_next")  # Qwen3-Next computes its Gated DeltaNet otherwise
    assert isinstance(config_to_hf(cfg), transformers.OlmoHybridConfig)


def test_bundled_config_is_the_published_size():
    """transformers' OlmoHybridConfig defaults (Olmo-Hybrid-7B, no RoPE as published) give the bundled config, whose
    parameter count transformers' meta-device model has, and come back."""
    from meshformer.config import load_config
    from meshformer.model.flops import count_params

    published = transformers.OlmoHybridConfig(rope_parameters={"rope_type": "default", "rope_theta": None})
    bundled = load_config("olmo-hybrid-7b").model
    cfg = config_from_hf(published)
    assert cfg.layer_types == bundled.layer_types and cfg.linear_attention == bundled.linear_attention
    assert cfg.norm == bundled.norm and cfg.attention == bundled.attention and cfg.position == bundled.position
    with torch.device("meta"):
        hf = transformers.OlmoHybridForCausalLM(published)
    assert count_params(bundled)["total"] == sum(p.numel() for p in hf.parameters()) == 7_430_870_688
    back = config_to_hf(bundled)
    assert back.layer_types == published.layer_types and back.linear_key_head_dim == 96
