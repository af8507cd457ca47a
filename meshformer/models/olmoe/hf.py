"""OLMoE (OlmoeForCausalLM): Qwen3-MoE's names and routing (norm_topk_prob = our router_renormalize, every block MoE,
experts intermediate_size wide) with OLMo 2's QK-norm over the whole q / k projection (qk_norm_scope="projection"),
pre-norm blocks, head_dim hidden_size / heads; clip_qkv (clamping q / k / v) and attention_bias are refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.config import ModelConfig, MoeConfig
from meshformer.models import llama_like
from meshformer.models.qwen3_moe import hf as qwen3_moe


def config_from_hf(c: Any) -> ModelConfig:
    llama_like.refuse_attention_bias(c, "olmoe")
    cfg = llama_like.config_from_hf(c, "olmoe")
    return replace(cfg, attention=replace(cfg.attention, head_dim=None, qk_norm=True, qk_norm_scope="projection"),
                   moe=MoeConfig(n_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                                 router_renormalize=c.norm_topk_prob, aux_loss=c.router_aux_loss_coef))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    shared = {k: v for k, v in llama_like.fields_to_hf(cfg).items() if k != "head_dim"}  # always hidden / heads
    return transformers.OlmoeConfig(
        **shared, intermediate_size=cfg.expert_d_ff, num_experts=cfg.moe.n_experts,
        num_experts_per_tok=cfg.moe.experts_per_token, norm_topk_prob=cfg.moe.router_renormalize,
        router_aux_loss_coef=cfg.moe.aux_loss, attention_bias=False, clip_qkv=None,
    )


ADAPTER = llama_like.adapter(
    "olmoe", "OlmoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    experts=qwen3_moe.EXPERTS,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "moe": True, "qk_norm": True,
                  "qk_norm_scope": "projection", "head_dim": "d_model/n_heads", "router_renormalize": {True, False}},
    size_keys=(*llama_like.SIZE_KEYS, "num_experts", "num_experts_per_tok"),
    width_and_heads=("hidden_size", "num_attention_heads"),
)
