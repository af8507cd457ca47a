"""DeepSeek-V2 and DeepSeek-V2-Lite (DeepseekV2ForCausalLM): DeepSeek-V3's blocks and names (models/deepseek_v3:
multi-head latent attention, queries direct when q_lora_rank is None as in Lite, YaRN's mscales, shared experts,
first_k_dense_replace) with DeepSeek-V2's router.

Routing: a softmax over all experts, the top-k weights never renormalised (transformers' DeepseekV2 ignores
norm_topk_prob) and multiplied by routed_scaling_factor (= our router_scale). topk_method "greedy" = our
router_groups 1; "group_limited_greedy" = router_groups n_group, router_groups_per_token topk_group, a group scored
by its best expert (= our moe.router_group_score "max"). No selection bias (e_score_correction_bias).

Rotary pairs are always interleaved (complex multiplication of adjacent columns) = our mla.rope_interleave true.

Refused: attention_bias, num_key_value_heads other than num_attention_heads, norm_topk_prob true (transformers ignores
it where DeepSeek's own code renormalises), another topk_method, another hidden_act.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, refuse
from meshformer.config import ModelConfig
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.deepseek_v3.hf import mla_config_from_hf, mla_fields_to_hf, mla_rules

ARCH = "deepseek_v2"
_TOPK_METHODS = ("greedy", "group_limited_greedy")


def config_from_hf(c: Any) -> ModelConfig:
    method = c.topk_method or "greedy"
    if method not in _TOPK_METHODS:
        raise refuse(ARCH, f"topk_method={method!r}", f"chooses experts otherwise than {' or '.join(_TOPK_METHODS)}")
    if c.norm_topk_prob:
        raise refuse(ARCH, "norm_topk_prob=True", "is ignored by transformers' DeepseekV2 (its weights stay "
                     "unnormalised) but renormalises in DeepSeek's own code, so the two disagree")
    grouped = method == "group_limited_greedy"
    return mla_config_from_hf(
        c, ARCH, router_score="softmax", router_renormalize=False,
        **({"router_groups": c.n_group, "router_groups_per_token": c.topk_group, "router_group_score": "max"}
           if grouped else {}))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    grouped = cfg.moe.router_groups > 1
    return transformers.DeepseekV2Config(
        **mla_fields_to_hf(cfg), norm_topk_prob=False, topk_method="group_limited_greedy" if grouped else "greedy",
        n_group=cfg.moe.router_groups if grouped else None,
        topk_group=cfg.moe.router_groups_per_token if grouped else None)


def rules(cfg: ModelConfig) -> list[Rule]:
    """DeepSeek-V3's names without the selection bias or multi-token prediction layers."""
    return mla_rules(cfg, selection_bias=False)


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Groups scored by their best expert, rotary pairs interleaved, no multi-token prediction modules (DeepSeek-V2
    has none)."""
    return {"router_group_score": cfg.moe.router_group_score if cfg.moe.router_groups > 1 else "max",
            "mla_rope_interleave": not cfg.uses_mla or cfg.mla.rope_interleave, "mtp_depth": cfg.mtp.depth}


ADAPTER = replace(llama_like.adapter(
    ARCH, "DeepseekV2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "mla"),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "mla": True, "moe": True, "n_shared_experts": ANY,
                  "router_score": "softmax", "router_renormalize": False, "router_groups": ANY,
                  "router_group_score": "max", "router_scale": ANY,
                  "moe_blocks": {"every block", "some"}, "grouped_query": False, "head_dim": ANY,
                  "mla_rope_interleave": True, "mtp_depth": 0},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
), rules=rules)
