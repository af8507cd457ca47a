"""Gemma 2 (Gemma2ForCausalLM), and what Gemma 3 (models/gemma3_text) shares with it: Llama's names with sandwich
norms (pre and post each sub-layer), RMSNorm scaling by (1 + weight) (norm_weight_offset=1), embeddings x
sqrt(d_model) rounded to the model dtype, gated GELU (tanh) MLP (our "geglu"), attention scale
query_pre_attn_scalar^-0.5, the sliding window on every block but each full_attention_every-th (layer_types),
final-logit soft-capping. Gemma 2 adds attention-logit soft-capping and one RoPE for all blocks. Refused: layer_types
other than that pattern, use_bidirectional_attention, attention_bias, another activation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, refuse
from meshformer.config import AttentionConfig, FfnConfig, InitConfig, ModelConfig, NormConfig
from meshformer.model.config import attention_pattern
from meshformer.models import llama_like

# attention_scale = query_pre_attn_scalar^-0.5 (an integer)
REQUIREMENTS = {**llama_like.REQUIREMENTS, "bias": False, "activation": "geglu", "norm_position": "sandwich",
                "norm_weight_offset": 1.0, "scale_embeddings": True, "attention_scale": ANY,
                "query_pre_attn_scalar": "integer", "attention_window": ANY, "full_attention_every": ANY,
                "attention_softcap": ANY, "logit_softcap": ANY}
SIZE_KEYS = (*llama_like.SIZE_KEYS, "head_dim", "sliding_window", "query_pre_attn_scalar")


def query_pre_attn_scalar(cfg: ModelConfig) -> int | None:
    """Gemma's attention scale as the integer whose inverse square root it is; None if it is no such integer's."""
    if cfg.attention.scale is None:
        return cfg.attention_head_dim
    scalar = round(cfg.attention.scale**-2)
    return scalar if scalar > 0 and scalar**-0.5 == cfg.attention.scale else None


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    return {"query_pre_attn_scalar": "integer" if query_pre_attn_scalar(cfg) else "none"}


def base_config(c: Any, arch: str) -> ModelConfig:
    """What Gemma 2 and Gemma 3 (text) share (each adds its [model.rope])."""
    if c.hidden_activation not in ("gelu_pytorch_tanh", "gelu_new"):
        raise refuse(arch, f"hidden_activation={c.hidden_activation!r}", "changes the gated MLP (meshformer's "
                     "geglu gates with gelu's tanh approximation)")
    llama_like.refuse_attention_bias(c, arch)
    if getattr(c, "use_bidirectional_attention", False):
        raise refuse(arch, "use_bidirectional_attention=True", "makes attention bidirectional")
    kinds = list(c.layer_types)
    window = None if c.sliding_window is None or "sliding_attention" not in kinds else c.sliding_window
    every = llama_like.full_attention_every(kinds, arch) if window is not None else None
    head_dim = c.head_dim
    kv = c.num_key_value_heads
    return ModelConfig(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        position="rope", scale_embeddings=True, logit_softcap=c.final_logit_softcapping,
        max_seq_len=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings, bias=False,
        layer_types=attention_pattern(window, every),
        attention=AttentionConfig(
            n_heads=c.num_attention_heads, n_kv_heads=None if kv in (None, c.num_attention_heads) else kv,
            head_dim=None if head_dim * c.num_attention_heads == c.hidden_size else head_dim, window=window,
            scale=None if c.query_pre_attn_scalar == head_dim else c.query_pre_attn_scalar**-0.5,
            dropout=c.attention_dropout),
        ffn=FfnConfig(d_ff=c.intermediate_size, activation="geglu"),
        norm=NormConfig(kind="rmsnorm", eps=c.rms_norm_eps, position="sandwich", weight_offset=1.0),
        init=InitConfig(std=c.initializer_range))


def fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    shared = {k: v for k, v in llama_like.fields_to_hf(cfg).items() if k not in ("hidden_act", "rope_parameters")}
    return dict(**shared, intermediate_size=cfg.ffn.d_ff, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                sliding_window=cfg.attention.window, layer_types=llama_like.layer_types_to_hf(cfg),
                query_pre_attn_scalar=query_pre_attn_scalar(cfg), final_logit_softcapping=cfg.logit_softcap,
                use_bidirectional_attention=False)


def config_from_hf(c: Any) -> ModelConfig:
    cfg = base_config(c, "gemma2")
    return replace(cfg, rope=llama_like.rope_config_from_hf(c, "gemma2"),
                   attention=replace(cfg.attention, softcap=c.attn_logit_softcapping))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Gemma2Config(**fields_to_hf(cfg), rope_parameters=llama_like.rope_to_hf(cfg),
                                     attn_logit_softcapping=cfg.attention.softcap)


ADAPTER = llama_like.adapter(
    "gemma2", "Gemma2ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements=REQUIREMENTS, size_keys=SIZE_KEYS, extra_features=extra_features,
)
