"""DeepSeek-V2's adapter beyond the rows every architecture has (test_model_references.py, test_checkpoint_convert.py,
test_generate_hf.py): DeepSeek-V2-Lite's published config.json giving the bundled config and coming back, the group
score of group_limited_greedy, and the refusals both ways."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from meshformer.checkpointing.hf import check_compatible, config_from_hf, config_to_hf, infer_arch
from meshformer.config import load_config
from meshformer.model.flops import count_params
from meshformer.model.moe import route

transformers = pytest.importorskip("transformers")

# deepseek-ai/DeepSeek-V2-Lite's config.json values (no download)
LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
            n_routed_experts=64, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128,
            qk_nope_head_dim=128, num_experts_per_tok=6, first_k_dense_replace=1, max_position_embeddings=163840,
            topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})


def test_published_lite_config_maps_both_ways():
    published = transformers.DeepseekV2Config(**LITE)
    cfg = config_from_hf(published)
    bundled = load_config("deepseek-v2-lite").model
    assert cfg == dataclasses.replace(bundled, moe=dataclasses.replace(bundled.moe, aux_loss=cfg.moe.aux_loss))
    assert infer_arch(bundled) == "deepseek_v2"
    back = config_to_hf(bundled)
    assert back.rope_parameters == published.rope_parameters
    for key in ("q_lora_rank", "kv_lora_rank", "topk_method", "norm_topk_prob", "n_shared_experts",
                "first_k_dense_replace", "routed_scaling_factor"):
        assert getattr(back, key) == getattr(published, key), key
    with torch.device("meta"):
        hf = transformers.DeepseekV2ForCausalLM(back)
    assert count_params(bundled)["total"] == sum(p.numel() for p in hf.parameters()) == 15_706_484_224


def test_group_limited_greedy_scores_a_group_by_its_best_expert():
    """Group 0 holds the best expert, group 1 the best pair: "max" keeps group 0, "top2_sum" group 1."""
    scores = torch.tensor([[0.50, 0.00, 0.30, 0.30]])
    logits = (scores + 1e-9).log()
    kept = {how: set(route(logits, 1, groups=2, groups_per_token=1, group_score=how,
                           renormalize=False).experts.tolist()[0]) for how in ("max", "top2_sum")}
    assert kept == {"max": {0}, "top2_sum": {2}}


def test_the_group_score_changes_what_the_imported_model_computes():
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.model.transformer import Transformer

    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=32))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    ours = from_hf_model(hf.eval()).eval()
    other = Transformer(dataclasses.replace(ours.cfg, moe=dataclasses.replace(ours.cfg.moe,
                                                                             router_group_score="top2_sum"))).eval()
    other.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-4)
        assert (other(ids) - expected).abs().max() > 1e-2


def _tiny_hf_config(**extra):
    return transformers.DeepseekV2Config(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
        "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 32, **extra})


@pytest.mark.parametrize(("extra", "named"), [
    ({"norm_topk_prob": True}, "norm_topk_prob=True"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
], ids=["renormalise", "topk-method", "attention-bias", "grouped-kv"])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        config_from_hf(_tiny_hf_config(**extra))


@pytest.mark.parametrize(("change", "named"), [
    (lambda c: dataclasses.replace(c, mla=dataclasses.replace(c.mla, rope_interleave=False)), "mla_rope_interleave"),
    (lambda c: dataclasses.replace(c, moe=dataclasses.replace(c.moe, router_renormalize=True)), "router_renormalize"),
    (lambda c: dataclasses.replace(c, moe=dataclasses.replace(c.moe, router_score="sigmoid")), "router_score"),
    (lambda c: dataclasses.replace(c, moe=dataclasses.replace(c.moe, router_groups=4, router_groups_per_token=2)),
     "router_group_score"),
    (lambda c: dataclasses.replace(c, mtp=dataclasses.replace(c.mtp, depth=1)), "mtp_depth"),
], ids=["half-split-rope", "renormalised", "sigmoid", "groups-by-top2", "mtp"])
def test_export_refuses_what_deepseek_v2_cannot_hold(change, named):
    cfg = load_config("deepseek-v2-lite").model
    check_compatible(cfg, "deepseek_v2")
    with pytest.raises(ValueError, match=named):
        check_compatible(change(cfg), "deepseek_v2")
