"""OLMo hybrid (OlmoHybridForCausalLM): Gated DeltaNet blocks (layer_types "linear_attention": our linear_attention
blocks, whose token mixer `attn` holds what HF names `linear_attn`) beside OLMo 3's attention blocks
("full_attention": models/olmo2's post-sub-layer norms and QK-norm over the whole q / k projection, no window).

Its blocks place their norms two ways: the attention blocks after each sub-layer (our norm.position =
"post_sublayer"), the Gated DeltaNet blocks before it (norm.by_kind = {linear_attention = "pre"}). Its Gated
DeltaNet stores separate q/k/v/g/b/a projections (our linear_attention.projections = "separate"; its g_proj = our
in_proj_z, o_proj = out_proj, o_norm = norm), doubles beta (linear_allow_neg_eigval = our allow_neg_eigval) and
normalises its output with epsilon 1e-5 whatever rms_norm_eps says (our linear_attention.norm_eps). Published
checkpoints set no rope_parameters: no positions at all (our position = "none"); with a rope_theta, RoPE.

Refused: attention_bias, another hidden_act, a rope scaling other than ours, layer_types naming other kinds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import PLAIN_KINDS, HFAdapter, refuse
from meshformer.config import ModelConfig, RopeConfig
from meshformer.model.config import LinearAttentionConfig
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.olmo2 import hf as olmo2
from meshformer.models.qwen3_next.hf import is_linear, shortest_pattern

ARCH = "olmo_hybrid"
OUTPUT_NORM_EPS = 1e-5  # transformers' OlmoHybridRMSNormGated, as flash-linear-attention's fused norm
# ours under the token mixer -> theirs under linear_attn
LINEAR_NAMES = {"in_proj_q": "q_proj", "in_proj_k": "k_proj", "in_proj_v": "v_proj", "in_proj_z": "g_proj",
                "in_proj_b": "b_proj", "in_proj_a": "a_proj", "out_proj": "o_proj", "norm": "o_norm",
                **{f"{p}_conv1d": f"{p}_conv1d" for p in "qkv"}}
# each block's norms as the checkpoints name them (transformers renames them in memory):
# (our attn_norm's, our ffn_norm's) in the Gated DeltaNet blocks (pre) and the attention blocks (post-sub-layer)
BLOCK_NORMS = {"pre": ("attention_layer_norm", "feedforward_layer_norm"),
               "post_sublayer": ("feedforward_layer_norm", "post_feedforward_layernorm")}


def _uses_rope(c: Any) -> bool:
    return (getattr(c, "rope_parameters", None) or {}).get("rope_theta") is not None


class _WithoutRope:
    """A config read as if it set no rope_parameters (published checkpoints: rope_theta None, no positions)."""

    def __init__(self, config: Any) -> None:
        self._config = config
        self.rope_parameters: dict[str, Any] = {}
        self.rope_scaling = None
        self.rope_theta = 10000.0  # read by llama_like, then dropped with the other rope fields

    def __getattr__(self, key: str) -> Any:
        return getattr(self._config, key)


def config_from_hf(c: Any) -> ModelConfig:
    kinds = list(c.layer_types)
    if set(kinds) - {"linear_attention", "full_attention"}:
        raise refuse(ARCH, f"layer_types={kinds}", "holds kinds other than linear_attention and full_attention")
    rope = _uses_rope(c)
    cfg = olmo2.base_config(c if rope else _WithoutRope(c), ARCH, window=False)
    if not rope:
        cfg = replace(cfg, position="none", rope=RopeConfig())
    cfg.layer_types = shortest_pattern(kinds)
    cfg.norm.by_kind = {"linear_attention": "pre"}
    cfg.linear_attention = LinearAttentionConfig(
        n_heads=c.linear_num_value_heads,
        n_key_heads=None if c.linear_num_key_heads == c.linear_num_value_heads else c.linear_num_key_heads,
        key_head_dim=c.linear_key_head_dim,
        value_head_dim=c.linear_value_head_dim, conv_width=c.linear_conv_kernel_dim, projections="separate",
        allow_neg_eigval=bool(c.linear_allow_neg_eigval), norm_eps=OUTPUT_NORM_EPS)
    return cfg


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    la = cfg.linear_attention
    fields = {k: v for k, v in olmo2.fields_to_hf(cfg).items() if k != "head_dim"}
    if cfg.position == "none":
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": None}  # as published: no RoPE
    return transformers.OlmoHybridConfig(
        **fields, layer_types=["linear_attention" if is_linear(cfg, i) else "full_attention"
                               for i in range(cfg.n_layers)],
        linear_num_value_heads=la.n_heads, linear_num_key_heads=la.key_heads, linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim, linear_conv_kernel_dim=la.conv_width,
        linear_allow_neg_eigval=la.allow_neg_eigval)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Llama's names with the block norms as checkpoints spell them, the Gated DeltaNet's under linear_attn."""
    linear = {f"decoder_layers.{i}." for i in range(cfg.n_layers) if is_linear(cfg, i)}
    out = [r for r in llama_like.rules(cfg) if not any(r.ours[0].startswith(f"{block}attn.") for block in linear)
           and not r.ours[0].endswith(("attn_norm.weight", "ffn_norm.weight"))]
    for i in range(cfg.n_layers):
        for ours, theirs in zip(("attn_norm", "ffn_norm"), BLOCK_NORMS[cfg.block_norm_position(i)], strict=True):
            out.append(Rule((f"decoder_layers.{i}.{ours}.weight",), f"model.layers.{i}.{theirs}.weight"))
        if is_linear(cfg, i):
            out += [Rule((f"decoder_layers.{i}.attn.{ours}.weight",), f"model.layers.{i}.linear_attn.{theirs}.weight")
                    for ours, theirs in LINEAR_NAMES.items()]
            out += [Rule((f"decoder_layers.{i}.attn.{p}",), f"model.layers.{i}.linear_attn.{p}")
                    for p in ("A_log", "dt_bias")]
    return out


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    linear = "linear_attention" in cfg.layer_types
    return {"separate_linear_projections": not linear or cfg.linear_attention.projections == "separate"}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="OlmoHybridForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "linear_attention"),
    rules=rules, base_prefix="model.", layer_keys=("num_hidden_layers",),
    hf_layer_types=("linear_attention", "full_attention"),
    requirements={**olmo2.REQUIREMENTS, "position": {"rope", "none"}, "linear_attention": True,
                  "norm_by_kind": (("linear_attention", "pre"),), "linear_allow_neg_eigval": {True, False},
                  "linear_norm_eps": OUTPUT_NORM_EPS, "separate_linear_projections": True},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
               "linear_value_head_dim", "linear_conv_kernel_dim"),
    width_and_heads=("hidden_size", "num_attention_heads"),
)
