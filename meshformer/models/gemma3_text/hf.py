"""Gemma 3, text only (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 (models/gemma2) plus the per-head
QK-norm (also 1 + weight) and RoPE per layer type: the windowed blocks' own base (rope_local_theta, unscaled) and
the global blocks' (rope_theta, with rope scaling). It reads attn_logit_softcapping but never applies it, so import
ignores it as transformers does and export refuses our attention_softcap. A scaled sliding-window RoPE is refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig
from meshformer.models import llama_like
from meshformer.models.gemma2 import hf as gemma2


def config_from_hf(c: Any) -> ModelConfig:
    cfg = gemma2.base_config(c, "gemma3_text")
    windowed = cfg.attention.window is not None
    return replace(cfg, rope=llama_like.rope_per_layer_type_config(c, "gemma3_text", windowed),
                   attention=replace(cfg.attention, qk_norm=True))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Gemma3TextConfig(**gemma2.fields_to_hf(cfg),
                                         rope_parameters=llama_like.rope_per_layer_type_to_hf(cfg))


ADAPTER = llama_like.adapter(
    "gemma3_text", "Gemma3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    # its sliding blocks always rotate unscaled (rope_parameters.sliding_attention)
    requirements={**gemma2.REQUIREMENTS, "qk_norm": True, "attention_softcap": None, "rope_local_theta": ANY,
                  "windowed_blocks_rope": "unscaled"},
    size_keys=gemma2.SIZE_KEYS, extra_features=gemma2.extra_features,
)
