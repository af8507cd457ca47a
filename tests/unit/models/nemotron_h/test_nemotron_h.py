"""Nemotron-H (meshformer/models/nemotron_h/) against transformers' NemotronHForCausalLM, random-initialised: one
mixer per layer as blocks with a `none` sub-layer (Mamba-2, attention, MLP and MoE layers); logits on a padded fp32
batch both ways, state dicts round trip bitwise, greedy generation equal, the published configs' parameter counts,
refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch

from meshformer.checkpointing.hf import config_from_hf, from_hf_model, incompatibilities, infer_arch
from meshformer.config import load_config
from meshformer.model import Transformer
from meshformer.model.flops import count_params
from tests.helpers.hf_models import assert_batched_greedy_equals_generate, hf_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_logits_both_ways_and_bitwise_round_trips():
    hf = hf_model("nemotron_h")
    with torch.no_grad():  # A_log, D, dt_bias, the norms and the experts' selection bias away from their initial
        # values too
        for p in hf.parameters():
            if p.ndim <= 1:
                p.add_(0.1 * torch.randn_like(p))
        hf.model.layers[1].mixer.gate.e_score_correction_bias.normal_(0.0, 0.1)
    ours = from_hf_model(hf).eval()
    assert ours.cfg.layer_types == ["mamba2", "none", "full_attention", "none"]
    assert ours.cfg.mlp_types == ["none", "moe", "none", "dense"]
    moe = ours.cfg.moe
    assert (moe.n_experts, moe.experts_per_token, moe.d_ff, moe.n_shared_experts) == (4, 2, 16, 2)
    routing = (moe.router_score, moe.router_groups, moe.router_groups_per_token, moe.router_scale)
    assert routing == ("sigmoid", 2, 1, 2.5)
    assert infer_arch(ours.cfg) == "nemotron_h"
    assert ours.decoder_layers["0"].ffn is None and ours.decoder_layers["1"].attn is None  # one sub-layer each
    assert torch.equal(ours.decoder_layers["1"].ffn.router.expert_bias,
                       hf.model.layers[1].mixer.gate.e_score_correction_bias)
    ids, mask = padded_batch(4096)
    assert_import_exact(hf, ours, ids, mask)
    mine = Transformer(ours.cfg).eval()
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(0.1 * torch.randn_like(p))
        mine.decoder_layers["1"].ffn.router.expert_bias.normal_(0.0, 0.1)
    assert_export_exact(mine, ids, mask)


def test_batched_greedy_generation_equals_transformers():
    assert_batched_greedy_equals_generate("nemotron_h", 6)


def test_published_config_has_transformers_count():
    """nvidia/Nemotron-H-8B-Base-8K's config.json values (no download) give the bundled config, whose parameter count
    the model transformers builds on the meta device has."""
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    published = transformers.NemotronHConfig(
        vocab_size=131072, hidden_size=4096, hybrid_override_pattern=pattern, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=21504, mlp_hidden_act="relu2", mamba_num_heads=128,
        mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, layer_norm_epsilon=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, time_step_min=0.001, use_conv_bias=True)
    cfg = config_from_hf(published)
    bundled = load_config("nemotron-h-8b").model
    assert cfg == bundled
    with torch.device("meta"):
        hf = transformers.NemotronHForCausalLM(published)
    assert count_params(bundled)["total"] == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize(("extra", "named"), [
    ({"layers_block_type": ["linear_attention", "moe"], "moe_latent_size": 16}, "moe_latent_size=16"),
    ({"layers_block_type": ["linear_attention", "moe"], "moe_shared_expert_intermediate_size": 24},
     "moe_shared_expert_intermediate_size=24"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
])
def test_import_refuses_what_it_cannot_express(extra, named):
    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=48, moe_intermediate_size=16, mamba_num_heads=4, mamba_head_dim=8,
                  ssm_state_size=8, n_groups=2,
                  layers_block_type=["linear_attention", "mlp"])
    with pytest.raises(ValueError, match=f"nemotron_h: {named}"):
        config_from_hf(transformers.NemotronHConfig(**{**fields, **extra}))


def test_published_moe_config_has_transformers_count():
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json values (no download; the mixture-of-experts line)
    give the bundled config, whose parameter count transformers' meta-device model has, within 3% of the published
    31.6B total."""
    published = transformers.NemotronHConfig(
        vocab_size=131072, hidden_size=2688,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", num_attention_heads=32,
        num_key_value_heads=2, head_dim=128, intermediate_size=1856, mlp_hidden_act="relu2",
        mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        layer_norm_epsilon=1e-5, max_position_embeddings=262144, tie_word_embeddings=False, time_step_min=0.001,
        use_conv_bias=True, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5)
    cfg = config_from_hf(published)
    bundled = load_config("nemotron-3-nano-30b-a3b").model
    assert cfg == replace(bundled, moe=replace(bundled.moe, router_bias_update_rate=0.0))  # a training setting
    with torch.device("meta"):
        hf = transformers.NemotronHForCausalLM(published)
    counts = count_params(bundled)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert abs(counts["total"] / 31.6e9 - 1) < 0.03


@pytest.mark.parametrize(("moe", "named"), [
    ({"router_score": "softmax"}, "nemotron_router='softmax'"),
    ({"n_shared_experts": 0}, "nemotron_shared_mlp=False"),
])
def test_export_refuses_experts_nemotron_h_cannot_hold(moe, named):
    """Nemotron-H's router scores by sigmoid and its E layers always hold the shared MLP."""
    cfg = load_config("tiny-nemotron-h").model
    assert incompatibilities(cfg, "nemotron_h") == []
    problems = incompatibilities(replace(cfg, moe=replace(cfg.moe, **moe)), "nemotron_h")
    assert any(problem.startswith(named) for problem in problems), problems
