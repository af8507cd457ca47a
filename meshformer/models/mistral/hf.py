"""Mistral (MistralForCausalLM): Llama plus sliding_window = our attention_window (both keep key j for query i when
i - j < window)."""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig
from meshformer.models import llama_like


def config_from_hf(c: Any) -> ModelConfig:
    return llama_like.config_from_hf(c, "mistral")


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.MistralConfig(**llama_like.fields_to_hf(cfg), intermediate_size=cfg.ffn.d_ff,
                                      sliding_window=cfg.attention.window)


ADAPTER = llama_like.adapter(
    "mistral", "MistralForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "attention_window": ANY},
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "sliding_window"),
)
