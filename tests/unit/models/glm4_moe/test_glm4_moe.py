"""GLM-4.5's adapter beyond the rows every architecture has (test_model_references.py, test_checkpoint_convert.py,
test_generate_hf.py): the published GLM-4.5-Air config.json giving the bundled config and coming back with
transformers' parameter count, the multi-token prediction layer both ways, and the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from meshformer.checkpointing.hf import (
    check_compatible,
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    to_hf_state_dict,
)
from meshformer.config import load_config
from meshformer.model.flops import count_params
from meshformer.model.transformer import Transformer

transformers = pytest.importorskip("transformers")

# zai-org/GLM-4.5-Air's config.json values (no download)
AIR = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
           num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
           use_qk_norm=False, n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, n_group=1,
           topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.0,
           max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1,
           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
TRAINING_ONLY = ("aux_loss", "aux_per_sequence", "router_bias_update_rate")  # no config.json key holds them


def test_published_air_config_maps_both_ways():
    published = transformers.Glm4MoeConfig(**AIR)
    cfg = config_from_hf(published)
    bundled = load_config("glm-4.5-air").model
    assert (cfg.rope.partial_factor, cfg.attention.qkv_bias, cfg.bias) == (0.5, True, False)
    assert cfg == dataclasses.replace(bundled, moe=dataclasses.replace(
        bundled.moe, **{k: getattr(cfg.moe, k) for k in TRAINING_ONLY}))
    with torch.device("meta"):
        hf = transformers.Glm4MoeForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters()) == 106_852_245_504
    back = config_to_hf(bundled)
    assert back.rope_parameters == published.rope_parameters
    for key in ("head_dim", "attention_bias", "use_qk_norm", "first_k_dense_replace", "n_shared_experts",
                "norm_topk_prob", "routed_scaling_factor", "num_key_value_heads"):
        assert getattr(back, key) == getattr(published, key), key


def _tiny(depth: int = 0) -> Transformer:
    cfg = load_config("glm-4.5-air", ["model.vocab_size=64", "model.d_model=32", "model.n_layers=2",
                                      "model.attention.n_heads=4", "model.attention.n_kv_heads=2",
                                      "model.attention.head_dim=16", "model.attention.qk_norm=true",
                                      "model.moe.n_experts=4", "model.moe.experts_per_token=2", "model.moe.d_ff=16",
                                      "model.ffn.d_ff=32", "model.mlp_types=['dense', 'moe']", "data.seq_len=32",
                                      f"model.mtp.depth={depth}"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # distinct values in every tensor, norms and the selection bias included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        model.decoder_layers["1"].ffn.router.expert_bias.normal_(0.0, 0.1)  # type: ignore[union-attr,operator]
    return model


def test_mtp_layer_crosses_both_ways_bitwise():
    """Module 0 is their layer num_hidden_layers: the DeepSeek names, the last block's attention (q/k/v biases,
    QK-norm) and experts."""
    model = _tiny(depth=1)
    state = to_hf_state_dict(model, "glm4_moe")
    n = model.cfg.n_layers
    layer = {k.removeprefix(f"model.layers.{n}.") for k in state if k.startswith(f"model.layers.{n}.")}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
            "shared_head.head.weight", "self_attn.q_proj.bias", "self_attn.k_norm.weight",
            "mlp.gate.e_score_correction_bias", "mlp.shared_experts.up_proj.weight"} <= layer
    assert config_to_hf(model.cfg, "glm4_moe").num_nextn_predict_layers == 1
    ours = from_hf_state_dict(state, model.cfg, "glm4_moe")
    expected = model.state_dict()
    assert set(ours) == set(expected)
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


def test_published_mtp_layer_is_left_unread_at_depth_zero():
    """GLM-4.5-Air's checkpoint holds its MTP module as layer 46, which transformers skips too."""
    model = _tiny()
    state = {**to_hf_state_dict(model, "glm4_moe"), "model.layers.46.eh_proj.weight": torch.ones(2, 2)}
    ours = from_hf_state_dict(state, model.cfg, "glm4_moe")
    assert not any("46" in k for k in ours)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.eh_proj\.weight"):  # any other stray layer is named
        from_hf_state_dict({**state, "model.layers.7.eh_proj.weight": torch.ones(2, 2)}, model.cfg, "glm4_moe")


def _tiny_hf_config(**extra):
    return transformers.Glm4MoeConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 32, **extra})


@pytest.mark.parametrize(("extra", "named"), [
    ({"n_shared_experts": 0}, "n_shared_experts=0"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
], ids=["no-shared-experts", "act", "dynamic-rope"])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        config_from_hf(_tiny_hf_config(**extra))


def test_export_refuses_what_glm_cannot_hold():
    cfg = _tiny().cfg
    check_compatible(cfg, "glm4_moe")
    with pytest.raises(ValueError, match="shared_experts"):
        check_compatible(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_shared_experts=0)), "glm4_moe")
    with pytest.raises(ValueError, match="router_score"):
        check_compatible(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_score="softmax")),
                         "glm4_moe")
