"""The `mla` token-mixer kind (model/components/mla.py): what it declares matches the module it builds (cache, TP
paths, init, rotary width), validation asks it, and the planner's bytes at its latent widths hold against a
measured step."""

from __future__ import annotations

import pytest
import torch

from meshformer.config import ConfigError, MlaConfig, config_from_dict
from meshformer.model import Transformer
from meshformer.model.components import TOKEN_MIXERS
from meshformer.model.config import AttentionConfig, ModelConfig, NormConfig
from meshformer.model.inspect import attention_weights

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = MlaConfig(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
DIRECT = MlaConfig(kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=6, v_head_dim=4)


def mla_config(mla: MlaConfig = LORA, **fields) -> ModelConfig:
    return ModelConfig(family="decoder", vocab_size=64, d_model=32, n_layers=2, max_seq_len=16, position="rope",
                       bias=False, layer_types=["mla"], attention=AttentionConfig(n_heads=4), mla=mla, **fields)


@pytest.mark.parametrize("mla", [LORA, DIRECT], ids=["lora", "direct"])
def test_the_cache_holds_what_the_kind_declares_per_token(mla):
    """After a cached forward of T tokens each block's cache holds B x T x (kv_lora_rank + qk_rope_head_dim)."""
    cfg = mla_config(mla)
    model = Transformer(cfg).eval()
    cache = model.new_cache()
    model.decode(torch.randint(0, 64, (2, 5)), cache=cache)
    per_token = TOKEN_MIXERS["mla"].cache_per_token(cfg)
    assert per_token == mla.kv_lora_rank + mla.qk_rope_head_dim
    for block_cache in cache:
        kv = block_cache.self_attn
        assert kv.k.numel() + kv.v.numel() == 2 * 5 * per_token  # type: ignore[union-attr]


@pytest.mark.parametrize("mla", [LORA, DIRECT], ids=["lora", "direct"])
def test_tensor_parallel_rules_name_the_modules_it_builds(mla):
    """Every rule but the other query path's projection names a submodule; the partial-gradient point is on the
    forward path (tensor parallel hooks it)."""
    cfg = mla_config(mla)
    kind = TOKEN_MIXERS["mla"]
    module = kind.build(cfg, causal=True)
    present = {path for path in kind.tp_rules(cfg) if path == "" or getattr(module, path, None) is not None}
    assert set(kind.tp_rules(cfg)) - present == {"q_b_proj" if mla.q_lora_rank is None else "q_proj"}
    seen = []
    module.get_submodule("shared_key").register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    model = Transformer(cfg)
    model.decoder_layers["0"].attn = module  # type: ignore[index]
    model(torch.randint(0, 64, (2, 5)))
    assert seen == [torch.Size([2, 5, mla.qk_rope_head_dim])]


def test_latent_norms_start_at_one_whatever_the_block_norms_offset():
    """The latent norms are plain RMSNorms: the kind's init rule fills 1 where the model's rule would fill
    1 - norm.weight_offset."""
    model = Transformer(mla_config(norm=NormConfig(kind="rmsnorm", weight_offset=1.0)))
    attention = model.decoder_layers["0"].attn  # type: ignore[index]
    assert torch.equal(attention.kv_a_norm.weight, torch.ones(LORA.kv_lora_rank))
    assert torch.equal(attention.q_a_norm.weight, torch.ones(LORA.q_lora_rank))  # type: ignore[arg-type]
    assert torch.equal(model.decoder_layers["0"].attn_norm.weight, torch.zeros(32))  # type: ignore[index]


def test_the_rotary_table_is_the_kinds_width():
    model = Transformer(mla_config(DIRECT))
    cos, _ = model.rope(torch.arange(3))  # type: ignore[misc]
    assert cos.shape[-1] == DIRECT.qk_rope_head_dim == model.cfg.rope_dim


def test_attention_weights_of_an_mla_layer():
    """The inspection hook reads MLA's softmax: one row per query, summing to 1, zero above the diagonal."""
    model = Transformer(mla_config())
    weights = attention_weights(model, torch.randint(0, 64, (1, 6)), layer=1)
    assert weights.shape == (1, 4, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 4, 6))
    assert not weights.triu(1).any()


def _raw(**model) -> dict:
    return {"model": {"family": "decoder", "vocab_size": 64, "d_model": 36, "n_layers": 2, "max_seq_len": 16,
                      "position": "rope", "bias": False, "attention": {"n_heads": 8}, **model},
            "data": {"seq_len": 16, "batch_size": 2}, "train": {"device": "cpu"}}


def test_head_width_checks_apply_to_kinds_that_read_them():
    """d_model 36 over 8 heads: refused for full_attention, whose heads are d_model / n_heads wide; accepted for
    mla, whose widths are [model.mla]'s."""
    with pytest.raises(ConfigError, match="model.d_model=36 is not divisible by model.attention.n_heads=8"):
        config_from_dict(_raw())
    cfg = config_from_dict(_raw(layer_types=["mla"], mla={"kv_lora_rank": 8, "qk_nope_head_dim": 4,
                                                          "qk_rope_head_dim": 2, "v_head_dim": 4}))
    assert cfg.model.rope_dim == 2


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_planned_peak_within_tolerance_of_measured(q_lora_rank):
    """The planner's peak for an MLA model (math backend: its softmax is what SDPA's CPU fallback keeps too) within
    bench/plan_validation.py's tolerance of a measured training step."""
    from plan_validation import TOLERANCE, validation_config

    from meshformer.planner.measure import measure_step_peak
    from meshformer.planner.search import plan_layout

    mla = {"q_lora_rank": q_lora_rank, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16}
    cfg = validation_config({"model": {"layer_types": ["mla"], "attention": {"n_heads": 8, "backend": "math"},
                                       "mla": mla}}, seq=128)
    predicted, measured = plan_layout(cfg, 1).peak, measure_step_peak(cfg)["peak"]
    assert abs(predicted / measured - 1) < TOLERANCE, (predicted, measured)
