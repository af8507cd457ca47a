"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention with Mixtral-style experts named mlp.experts.{j}.gate_proj /
up_proj / down_proj and the router mlp.gate. It takes the top-k of the softmax over all experts, renormalised when
norm_topk_prob (= our router_renormalize). decoder_sparse_step = our moe_every and mlp_only_layers = our
moe_first_dense when it lists the first blocks (else refused); dense blocks are intermediate_size wide, experts
moe_intermediate_size (= our d_ff, moe_d_ff). router_aux_loss_coef <-> moe_aux_loss; router_jitter_noise is ignored
as for Mixtral."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.checkpointing.megatron_config import moe_every_pattern
from meshformer.config import ModelConfig, MoeConfig
from meshformer.model.config import moe_pattern
from meshformer.models import llama_like

EXPERTS: llama_like.Experts = ("mlp.gate", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj"))


def config_from_hf(c: Any) -> ModelConfig:
    llama_like.refuse_attention_bias(c, "qwen3_moe")
    cfg = llama_like.config_from_hf(c, "qwen3_moe")
    dense = moe_pattern(c.decoder_sparse_step, len(c.mlp_only_layers or []), cfg.n_layers) if c.num_experts else []
    return replace(cfg, attention=replace(cfg.attention, qk_norm=True), mlp_types=dense, moe=MoeConfig(
        n_experts=c.num_experts, experts_per_token=c.num_experts_per_tok, d_ff=c.moe_intermediate_size,
        router_renormalize=c.norm_topk_prob, aux_loss=c.router_aux_loss_coef))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    first_dense, every = moe_every_pattern([cfg.is_moe(i) for i in range(cfg.n_layers)])
    return transformers.Qwen3MoeConfig(
        **llama_like.fields_to_hf(cfg), intermediate_size=cfg.ffn.d_ff, moe_intermediate_size=cfg.expert_d_ff,
        use_sliding_window=cfg.attention.window is not None, sliding_window=cfg.attention.window,
        num_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        norm_topk_prob=cfg.moe.router_renormalize, decoder_sparse_step=every,
        mlp_only_layers=list(range(first_dense)), router_aux_loss_coef=cfg.moe.aux_loss,
        attention_bias=False,
    )


ADAPTER = llama_like.adapter(
    "qwen3_moe", "Qwen3MoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    experts=EXPERTS,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "moe": True, "attention_window": ANY, "qk_norm": True,
                  "router_renormalize": {True, False}, "moe_blocks": {"every block", "some"}},
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "decoder_sparse_step"),
)
