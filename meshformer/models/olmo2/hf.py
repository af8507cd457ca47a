"""OLMo 2 (Olmo2ForCausalLM): Llama's names with no pre-norms; each sub-layer's output is normalised before the
residual add (our norm_position="post_sublayer"); QK-norm over the whole q / k projection (all heads at once:
qk_norm_scope="projection"), before RoPE; head_dim always hidden_size / heads. attention_bias (on Q/K/V/O, not the
MLP) is refused."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.config import ModelConfig
from meshformer.models import llama_like

REQUIREMENTS = {**llama_like.REQUIREMENTS, "bias": False, "norm_position": "post_sublayer", "qk_norm": True,
                "qk_norm_scope": "projection", "head_dim": "d_model/n_heads"}


def fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    shared = {k: v for k, v in llama_like.fields_to_hf(cfg).items() if k != "head_dim"}  # always hidden / heads
    return {**shared, "intermediate_size": cfg.ffn.d_ff, "attention_bias": False}


def base_config(c: Any, arch: str, window: bool = True) -> ModelConfig:
    """OLMo 2's blocks, typed (OLMo 3 adds its windows and per-layer-type RoPE)."""
    llama_like.refuse_attention_bias(c, arch)
    cfg = llama_like.config_from_hf(c, arch, window)
    return replace(cfg, attention=replace(cfg.attention, head_dim=None, qk_norm=True, qk_norm_scope="projection"),
                   norm=replace(cfg.norm, position="post_sublayer"))


def config_from_hf(c: Any) -> ModelConfig:
    return base_config(c, "olmo2")


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Olmo2Config(**fields_to_hf(cfg))


ADAPTER = llama_like.adapter(
    "olmo2", "Olmo2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements=REQUIREMENTS, width_and_heads=("hidden_size", "num_attention_heads"),
)
