"""Qwen2 (Qwen2ForCausalLM): biases on Q/K/V only = our qkv_bias=True with bias=False. Qwen2/Qwen3 use the window
only in blocks from max_window_layers on: all or none of them maps (export writes max_window_layers=0), a mix is
refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig
from meshformer.models import llama_like

SIZE_KEYS = (*llama_like.SIZE_KEYS, "head_dim", "sliding_window")


def window_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen's window arguments: the window in every block (from max_window_layers = 0 on), or none."""
    return dict(use_sliding_window=cfg.attention.window is not None, sliding_window=cfg.attention.window,
                max_window_layers=0)


def config_from_hf(c: Any) -> ModelConfig:
    cfg = llama_like.config_from_hf(c, "qwen2")
    return replace(cfg, attention=replace(cfg.attention, qkv_bias=True))  # always, Q/K/V only


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Qwen2Config(**llama_like.fields_to_hf(cfg), **window_to_hf(cfg), intermediate_size=cfg.ffn.d_ff)


ADAPTER = llama_like.adapter(
    "qwen2", "Qwen2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**llama_like.REQUIREMENTS, "bias": False, "qkv_bias": True, "attention_window": ANY},
    size_keys=SIZE_KEYS,
)
