"""Qwen3 (Qwen3ForCausalLM): Qwen2's window handling, QK-norm (one RMSNorm of width head_dim per query / key head) =
our qk_norm; attention_bias=True (on Q/K/V/O but not the MLP) is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig
from meshformer.models import llama_like
from meshformer.models.qwen2.hf import SIZE_KEYS, window_to_hf


def config_from_hf(c: Any) -> ModelConfig:
    llama_like.refuse_attention_bias(c, "qwen3")
    cfg = llama_like.config_from_hf(c, "qwen3")
    return replace(cfg, attention=replace(cfg.attention, qk_norm=True))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Qwen3Config(**llama_like.fields_to_hf(cfg), **window_to_hf(cfg), intermediate_size=cfg.ffn.d_ff,
                                    attention_bias=False)


ADAPTER = llama_like.adapter(
    "qwen3", "Qwen3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "qk_norm": True, "attention_window": ANY},
    size_keys=SIZE_KEYS,
)
