"""Llama (LlamaForCausalLM): the shared Llama-like mapping (models/llama_like.py); attention_bias must equal mlp_bias
(our `bias` covers every linear)."""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import refuse
from meshformer.config import ModelConfig
from meshformer.models import llama_like


def config_from_hf(c: Any) -> ModelConfig:
    if c.attention_bias != getattr(c, "mlp_bias", c.attention_bias):
        raise refuse("llama", f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}",
                     "puts biases on only some linears (meshformer's model.bias covers all of them)")
    return llama_like.config_from_hf(c, "llama")


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.LlamaConfig(**llama_like.fields_to_hf(cfg), intermediate_size=cfg.ffn.d_ff,
                                    attention_bias=cfg.bias, mlp_bias=cfg.bias)


ADAPTER = llama_like.adapter(
    "llama", "LlamaForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    size_keys=(*llama_like.SIZE_KEYS, "head_dim"), width_and_heads=("hidden_size", "num_attention_heads"),
)
