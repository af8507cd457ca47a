"""Qwen3.5's language model (Qwen3_5ForCausalLM, model_type "qwen3_5_text"): Qwen3-Next's hybrid of Gated DeltaNet
and gated attention blocks (meshformer/models/qwen3_next/hf.py, whose shared helpers this reuses) with a dense
SwiGLU MLP in every block and the Gated DeltaNet's input projections stored split (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a = our linear_attention.projections = "split").

Its rotary embedding is multimodal (rope_parameters.mrope_section: the rotated pairs split between temporal, height
and width positions). For text every token has the same position on all three axes, so it computes plain RoPE over
the first partial_rotary_factor of each head; the mrope keys are accepted and written back with their defaults.
The multi-token-prediction weights (mtp.*) and a multimodal checkpoint's vision tower (model.visual.*) are left unread.

Refused: attention_bias, another hidden_act, rotary scaling other than ours.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, HFAdapter
from meshformer.config import ModelConfig
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.qwen3_next.hf import hybrid_from_hf, hybrid_rules, hybrid_to_hf

ARCH = "qwen3_5_text"
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
LINEAR_PARAMS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                 "dt_bias", "A_log", "norm.weight", "out_proj.weight")


def config_from_hf(c: Any) -> ModelConfig:
    cfg = hybrid_from_hf(c, ARCH, drop_rope_keys=MROPE_KEYS)
    cfg.linear_attention.projections = "split"
    return cfg


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.Qwen3_5TextConfig(**hybrid_to_hf(cfg))


def rules(cfg: ModelConfig) -> list[Rule]:
    """Llama's names, the Gated DeltaNet's split projections in the linear_attention blocks."""
    return hybrid_rules(cfg, None, LINEAR_PARAMS)


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Its Gated DeltaNet stores the split projections."""
    linear = "linear_attention" in cfg.layer_types
    return {"split_linear_projections": not linear or cfg.linear_attention.projections == "split"}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="Qwen3_5ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "linear_attention"),
    rules=rules, base_prefix="model.", layer_keys=("num_hidden_layers",),
    hf_layer_types=("linear_attention", "full_attention"),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "qk_norm": True, "norm_weight_offset": 1.0,
                  "attention_output_gate": True, "rope_partial_factor": ANY, "linear_attention": {True, False},
                  "split_linear_projections": True},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "linear_num_value_heads", "linear_num_key_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"),
    ignored=r"^(mtp|model\.visual)\.",
    old_names=lambda name: name.replace("model.language_model.", "model.", 1),
)
