"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): Llama's pre-norm blocks and names with grouped-query attention that
rotates the first partial_rotary_factor of each head (= our rope.partial_factor, half-split pairs), biases on q/k/v
only when attention_bias (= our qkv_bias, o_proj never has one), per-head QK-norm when use_qk_norm, and DeepSeek-V3's
mixture of experts after the first dense blocks.

Experts: the router mlp.gate (sigmoid scores; e_score_correction_bias = our router.expert_bias), n_group /
topk_group = our router_groups / router_groups_per_token, norm_topk_prob = router_renormalize,
routed_scaling_factor = router_scale; per-expert mlp.experts.{j}.gate_proj / up_proj / down_proj of width
moe_intermediate_size; mlp.shared_experts (n_shared_experts of that width, one FFN). first_k_dense_replace = our
moe_first_dense, those blocks' MLP intermediate_size wide.

Multi-token prediction as DeepSeek-V3's (models/deepseek_v3): with model.mtp.depth > 0 our module k is their layer
num_hidden_layers + k, read on import and written on export (num_nextn_predict_layers = depth). An import builds
depth 0 unless model.mtp.depth is set; then the published checkpoints' model.layers.46 (GLM-4.5-Air) or
model.layers.92 (GLM-4.5) is left unread, as transformers leaves it.

Refused: n_shared_experts = 0 (transformers then builds empty shared experts), another hidden_act, rotary scaling
other than ours.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, refuse
from meshformer.config import ModelConfig, MoeConfig
from meshformer.model.config import moe_pattern
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.deepseek_v3.hf import mtp_rules, shared_expert_rules
from meshformer.models.qwen3_moe.hf import EXPERTS

ARCH = "glm4_moe"


class _RopeWithoutPartial:
    """The config as llama_like reads it: rope_parameters without partial_rotary_factor (read here)."""

    def __init__(self, c: Any, rope: dict[str, Any]) -> None:
        self._c, self.rope_parameters = c, rope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def config_from_hf(c: Any) -> ModelConfig:
    if not c.n_shared_experts:
        raise refuse(ARCH, f"n_shared_experts={c.n_shared_experts}", "builds zero-width shared experts")
    rope = dict(c.rope_parameters or {})
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(c, "partial_rotary_factor", None) or 1.0)
    cfg = llama_like.config_from_hf(_RopeWithoutPartial(c, rope), ARCH, window=False)
    experts = c.n_routed_experts
    return replace(
        cfg, bias=False, rope=replace(cfg.rope, partial_factor=partial),
        attention=replace(cfg.attention, qkv_bias=bool(c.attention_bias), qk_norm=bool(c.use_qk_norm)),
        mlp_types=moe_pattern(1, c.first_k_dense_replace or 0, cfg.n_layers) if experts else [],
        moe=MoeConfig(n_experts=experts, experts_per_token=c.num_experts_per_tok, d_ff=c.moe_intermediate_size,
                      n_shared_experts=c.n_shared_experts or 0, router_score="sigmoid",
                      router_renormalize=bool(c.norm_topk_prob), router_groups=c.n_group or 1,
                      router_groups_per_token=c.topk_group or 1, router_scale=float(c.routed_scaling_factor)))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    fields = llama_like.fields_to_hf(cfg)
    fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": cfg.rope.partial_factor}
    first_dense = next((i for i in range(cfg.n_layers) if cfg.is_moe(i)), cfg.n_layers)
    return transformers.Glm4MoeConfig(
        **fields, intermediate_size=cfg.ffn.d_ff, moe_intermediate_size=cfg.expert_d_ff,
        attention_bias=cfg.use_qkv_bias, use_qk_norm=cfg.attention.qk_norm,
        n_routed_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        n_shared_experts=cfg.moe.n_shared_experts, norm_topk_prob=cfg.moe.router_renormalize,
        n_group=cfg.moe.router_groups, topk_group=cfg.moe.router_groups_per_token,
        routed_scaling_factor=cfg.moe.router_scale, first_k_dense_replace=first_dense,
        num_nextn_predict_layers=cfg.mtp.depth)  # type: ignore[call-arg]  # an attribute_map alias


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Every MoE block has shared experts (transformers builds them n_shared_experts x moe_intermediate_size wide)."""
    return {"shared_experts": cfg.moe.n_experts == 0 or cfg.moe.n_shared_experts > 0}


def rules(cfg: ModelConfig) -> list[Rule]:
    """Llama's names (q/k/v biases, QK-norm as the config has them), DeepSeek's router selection bias and shared
    experts, and the multi-token prediction layers."""
    out = llama_like.rules(cfg, EXPERTS) + shared_expert_rules(cfg, selection_bias=True)
    return out + mtp_rules(cfg, out)


ADAPTER = replace(llama_like.adapter(
    ARCH, "Glm4MoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "qkv_bias": {"as bias", True}, "qk_norm": {False, True},
                  "rope_partial_factor": ANY, "moe": True, "n_shared_experts": ANY, "router_score": "sigmoid",
                  "router_renormalize": {True, False}, "router_groups": ANY, "router_scale": ANY,
                  "moe_blocks": {"every block", "some"}, "shared_experts": True},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    ignored=r"^model\.layers\.(46|92)\.", holds_selection_bias=True,
), rules=rules)
