"""Mixtral (MixtralForCausalLM): each expert's w1 / w3 / w2 nn.Linear (out, in) is one slice of our stacked
(n_experts, in, out) gate / up / down tensor, transposed; the router `gate` = our router. Every block is MoE; it
takes the top-k of the softmax over all experts, renormalised (= a softmax over the top-k logits).
router_aux_loss_coef <-> moe_aux_loss (a training knob, carried as is). router_jitter_noise is training-only input
noise, like dropout, so it is not part of the function: import ignores it, export writes 0. No shared experts,
sigmoid scores, group-limited routing, capacity dropping or selection bias (the requirement table refuses them)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig, MoeConfig
from meshformer.models import llama_like


def config_from_hf(c: Any) -> ModelConfig:
    return replace(llama_like.config_from_hf(c, "mixtral"), moe=MoeConfig(
        n_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok, router_renormalize=True,
        aux_loss=c.router_aux_loss_coef))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.MixtralConfig(
        **llama_like.fields_to_hf(cfg), intermediate_size=cfg.expert_d_ff, sliding_window=cfg.attention.window,
        num_local_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        router_aux_loss_coef=cfg.moe.aux_loss, router_jitter_noise=0.0,
    )


ADAPTER = llama_like.adapter(
    "mixtral", "MixtralForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    experts=("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "moe": True, "attention_window": ANY},
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window"),
)
