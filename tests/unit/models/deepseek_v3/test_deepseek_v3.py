"""DeepSeek-V3's adapter and bundled configs beyond the rows every architecture has (test_model_references.py): the
published config.json values giving the bundled configs and coming back, DeepSeek-V2-Lite's count against
transformers' DeepseekV2 model, the selection bias both ways, the refusals, and the validation of mla configs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from meshformer.checkpointing.hf import check_compatible, config_from_hf, config_to_hf, from_hf_state_dict
from meshformer.config import ConfigError, load_config
from meshformer.model.flops import count_params

transformers = pytest.importorskip("transformers")

V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
# config.json values (no download); transformers' DeepseekV3Config defaults are DeepSeek-V3's other values
PUBLISHED = {
    "deepseek-v3": dict(max_position_embeddings=163840, rope_parameters=V3_ROPE),
    "kimi-k2": dict(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                    routed_scaling_factor=2.827, n_group=1, topk_group=1, first_k_dense_replace=1,
                    max_position_embeddings=131072, rope_parameters={
                        **V3_ROPE, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0}),
}
TRAINING_ONLY = ("aux_loss", "aux_per_sequence", "router_bias_update_rate")  # no config.json key holds them


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_configs_map_both_ways(name):
    """The published config gives the bundled one (but its training-only balance settings), the model transformers
    builds from it on the meta device has our parameter count, and it comes back with the same rope parameters."""
    published = transformers.DeepseekV3Config(**PUBLISHED[name])
    cfg = config_from_hf(published)
    bundled = load_config(name).model
    assert cfg.rope.attention_factor == 1.0 and cfg.mla.mscale_all_dim == 1.0  # mscale / mscale_all_dim = 1
    assert cfg == dataclasses.replace(bundled, moe=dataclasses.replace(
        bundled.moe, **{k: getattr(cfg.moe, k) for k in TRAINING_ONLY}))
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(published)
    assert count_params(cfg)["total"] == sum(p.numel() for p in hf.parameters())
    back = config_to_hf(bundled)
    assert back.rope_parameters == published.rope_parameters
    assert (back.first_k_dense_replace, back.n_group, back.topk_group, back.routed_scaling_factor) == (
        published.first_k_dense_replace, published.n_group, published.topk_group, published.routed_scaling_factor)


def test_deepseek_v2_lite_counts_what_transformers_builds():
    """DeepSeek-V2-Lite's published shape (queries without a latent) in transformers' DeepseekV2 model."""
    cfg = load_config("deepseek-v2-lite").model
    with torch.device("meta"):
        hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
            n_routed_experts=64, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
            qk_nope_head_dim=128, num_experts_per_tok=6, first_k_dense_replace=1, max_position_embeddings=163840))
    counts = count_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    unused = 26 * (64 - 6) * 3 * 2048 * 1408  # per MoE block, the routed experts a token does not use
    assert counts["active"] == counts["total"] - unused


def _tiny(**extra):
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 16,
        "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 4,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "max_position_embeddings": 32, **extra}))


def _saved(hf) -> dict[str, torch.Tensor]:
    """The tensors as save_pretrained writes them (per-expert linears), which checkpoints hold."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf, dict(hf.state_dict()))


def test_selection_bias_crosses_both_ways_and_other_architectures_refuse_it():
    hf = _tiny()
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    cfg = config_from_hf(hf.config)
    ours = from_hf_state_dict(_saved(hf), cfg, "deepseek_v3")
    assert torch.equal(ours["decoder_layers.1.ffn.router.expert_bias"], bias)
    from meshformer.checkpointing.hf import check_exportable

    check_exportable(ours, "deepseek_v3")  # kept: its router has the term
    with pytest.raises(ValueError, match=r"mixtral: decoder_layers\.1\.ffn\.router\.expert_bias is nonzero"):
        check_exportable(ours, "mixtral")


@pytest.mark.parametrize(("extra", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='dynamic'"),
], ids=["attention-bias", "grouped-kv", "act", "dynamic-rope"])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        config_from_hf(_tiny(**extra).config)


def test_fp8_checkpoints_are_refused_with_the_fix():
    hf = _tiny()
    state = {**_saved(hf), "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(ValueError, match=r"deepseek_v3: model\.layers\.0\.self_attn\.o_proj\.weight_scale_inv: .*"
                                         r"quant_method.*fp8"):
        from_hf_state_dict(state, config_from_hf(hf.config), "deepseek_v3")


def test_multi_token_prediction_layer_is_left_unread():
    """The published checkpoints hold their MTP module as layer 61, which transformers skips too."""
    hf = _tiny()
    state = {**_saved(hf), "model.layers.61.eh_proj.weight": torch.ones(2, 2)}
    ours = from_hf_state_dict(state, config_from_hf(hf.config), "deepseek_v3")
    assert not any("61" in k for k in ours)


def test_other_architectures_refuse_mla_and_routed_scaling():
    cfg = load_config("tiny-deepseek").model
    check_compatible(cfg, "deepseek_v3")
    for arch in ("llama", "qwen3_moe", "mixtral"):
        with pytest.raises(ValueError, match="kind 'mla'"):
            check_compatible(cfg, arch)
    from meshformer.checkpointing.megatron_config import megatron_incompatibilities

    assert any("mla" in problem for problem in megatron_incompatibilities(cfg))


@pytest.mark.parametrize(("overrides", "message"), [
    (['model.layer_types=["mla", "full_attention"]'], "mixes mla with other token mixers"),
    (["model.position=alibi"], "mla blocks are causal self-attention with RoPE"),
    (["model.mla.qk_rope_head_dim=15"], "model.mla.qk_rope_head_dim=15 must be even"),
    (["model.mla.kv_lora_rank=0"], "model.mla.kv_lora_rank=0 must be positive"),
    (["model.attention.n_kv_heads=2"], "model.attention.n_kv_heads is set, but mla blocks do not use it"),
    (["model.attention.sinks=true"], "model.attention.sinks is set, but mla blocks do not use it"),
    (["model.moe.router_scale=0"], "model.moe.router_scale=0.0 must be positive"),
])
def test_bad_mla_configs_get_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("tiny-deepseek", overrides)



@pytest.mark.parametrize("backend", ["auto", "blockwise"])
def test_the_run_log_names_the_kernel_mla_runs(backend):
    """MLA has no blockwise kernel: the layout report says SDPA, as model/mla.py runs it."""
    from meshformer.parallel.kernels import attention_kernels

    cfg = load_config("tiny-deepseek", [f"model.attention.backend={backend}"])
    assert attention_kernels(cfg, torch.device("cpu"), compiled=False).startswith("SDPA")
