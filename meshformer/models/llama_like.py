"""What the architectures built on Llama's blocks and names share: the Llama requirement table, the config fields
both ways, RoPE parameters, sliding windows and layer_types patterns, and an adapter with Llama's tensor names.

Llama: RMSNorm, SwiGLU, half-split RoPE, grouped-query heads, untied head: names only. head_dim = ours;
rope_parameters of rope_type linear / llama3 / yarn = our rope_scaling and rope_* keys (Llama 3.1/3.2's llama3);
yarn's truncate = our rope_truncate; other rope types and keys we lack (yarn's mscale, partial_rotary_factor) are
refused.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, COMMON, HFAdapter, refuse
from meshformer.config import AttentionConfig, FfnConfig, InitConfig, ModelConfig, NormConfig, RopeConfig
from meshformer.model.config import attention_pattern
from meshformer.model.families.naming import Rule, expert_params, norm, params
from meshformer.model.moe import is_moe_block

REQUIREMENTS: dict[str, Any] = {**COMMON, "family": "decoder", "position": "rope", "norm": "rmsnorm",
                                "activation": "swiglu", "grouped_query": {False, True}, "head_dim": ANY,
                                "rope_scaling": ANY}
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")


# An MoE block's router, expert j's prefix ("{j}") and its gate / up / down linears, as a checkpoint names them; or,
# for experts stored otherwise, the rules of an MoE block's router and experts given (our block's prefix, theirs, cfg)
Experts = tuple[str, str, tuple[str, str, str]] | Callable[[str, str, ModelConfig], list[Rule]]

# Our block norms -> HF's names, by where the norms sit: Llama's pre-norms; OLMo 2's norms of the sub-layer outputs;
# Gemma's pre- and post-norms around each sub-layer.
_HF_BLOCK_NORMS = {
    "pre": (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")),
    "post_sublayer": (("attn_norm", "post_attention_layernorm"), ("ffn_norm", "post_feedforward_layernorm")),
    "sandwich": (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
                 ("ffn_norm", "pre_feedforward_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")),
}


def rules(cfg: ModelConfig, experts: Experts | None = None) -> list[Rule]:
    """Llama's names, with the block norms where `cfg.norm_position` puts them and an MoE block's router and experts
    named as `experts` says (an architecture with MoE blocks gives it)."""
    linear = ("weight", "bias") if cfg.bias else ("weight",)
    qkv_linear = ("weight", "bias") if cfg.use_qkv_bias else ("weight",)
    out = [Rule(("tok_embeddings.weight",), "model.embed_tokens.weight"), *norm("decoder_norm", "model.norm", cfg),
             Rule(("output.weight",), "lm_head.weight", alias=cfg.tie_embeddings)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"model.layers.{i}"
        for ours, theirs in _HF_BLOCK_NORMS[cfg.block_norm_position(i)]:
            out += norm(f"{o}.{ours}", f"{t}.{theirs}", cfg)
        for p in ("q", "k", "v", "o"):
            out += params(f"{o}.attn.{p}_proj", f"{t}.self_attn.{p}_proj", linear if p == "o" else qkv_linear)
        if cfg.attention.qk_norm:
            out += [Rule((f"{o}.attn.{p}_norm.weight",), f"{t}.self_attn.{p}_norm.weight") for p in "qk"]
        if cfg.attention.sinks:
            out += [Rule((f"{o}.attn.sinks.weight",), f"{t}.self_attn.sinks")]
        if is_moe_block(cfg, i):
            assert experts is not None, "the requirements keep experts from an architecture without them"
            if callable(experts):
                out += experts(o, t, cfg)
                continue
            router, expert, (gate, up, down) = experts
            out += [Rule((f"{o}.ffn.router.weight",), f"{t}.{router}.weight")]
            for ours, theirs in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                out += expert_params(f"{o}.ffn.experts.{ours}", f"{t}.{expert}{theirs}.weight", cfg.moe.n_experts)
        else:
            for p in ("gate", "up", "down"):
                out += params(f"{o}.ffn.{p}_proj", f"{t}.mlp.{p}_proj", linear)
    return out


def adapter(model_type: str, model_class: str, experts: Experts | None = None, **fields: Any) -> HFAdapter:
    """An adapter with Llama's tensor names ("model." base, `rules`)."""
    fields = {"size_keys": SIZE_KEYS, "requirements": REQUIREMENTS, **fields}
    return HFAdapter(model_type=model_type, model_class=model_class, base_prefix="model.",
                     layer_keys=("num_hidden_layers",), rules=partial(rules, experts=experts), **fields)


# The rope_parameters keys each rope_type may carry (rope_theta aside), and our [model.rope] keys for them.
_SCALED = {"factor": "factor", "original_max_position_embeddings": "original_max_seq_len"}
_ROPE_KEYS = {"linear": {"factor": "factor"},
              "llama3": {**_SCALED, "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor"},
              "yarn": {**_SCALED, "beta_fast": "beta_fast", "beta_slow": "beta_slow",
                       "attention_factor": "attention_factor", "truncate": "truncate"}}
def rope_config_from_hf(c: Any, arch: str) -> RopeConfig:
    """Our [model.rope] for HF's rope_parameters (transformers 5; rope_scaling in older configs)."""
    return RopeConfig(**_rope_fields(c, arch))


def _rope_fields(c: Any, arch: str) -> dict[str, Any]:
    """The [model.rope] keys HF's rope_parameters set."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    fields: dict[str, Any] = {"theta": float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type: rope_per_layer_type_config
        return fields
    if rope.get("partial_rotary_factor") == 1:  # every dimension rotates: what ours do
        del rope["partial_rotary_factor"]
    if kind != "default" and kind not in _ROPE_KEYS:
        raise refuse(arch, f"rope_type={kind!r}", "rescales the rotary frequencies its own way")
    for key, value in rope.items():  # transformers' default RoPE reads partial_rotary_factor too
        if key not in _ROPE_KEYS.get(kind, {}) and value is not None:
            raise refuse(arch, f"rope_parameters.{key}={value!r}", f"changes {kind} rotary frequencies")
    if kind == "default":
        return fields
    return {**fields, "scaling": kind, **{ours: rope[key] for key, ours in _ROPE_KEYS[kind].items()
                                          if rope.get(key) is not None}}


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope.scaling == "none" else cfg.rope.scaling,
                            "rope_theta": cfg.rope.theta}
    for key, ours in _ROPE_KEYS.get(cfg.rope.scaling, {}).items():
        if getattr(cfg.rope, ours) is not None:
            rope[key] = getattr(cfg.rope, ours)
    if rope.get("truncate") is True:  # yarn's default: written only when off, as published configs do
        del rope["truncate"]
    return rope


def rope_per_layer_type_config(c: Any, arch: str, windowed: bool) -> RopeConfig:
    """rope_parameters per layer type (Gemma 3, OLMo 3): the global blocks' RoPE (maybe scaled) = our [model.rope],
    the windowed blocks' own base = our rope.local_theta (unscaled, as ours always is)."""
    return RopeConfig(**_rope_per_layer_type(c, arch, windowed))


def _rope_per_layer_type(c: Any, arch: str, windowed: bool) -> dict[str, Any]:
    rope = c.rope_parameters
    local = dict(rope["sliding_attention"])
    if local.pop("rope_type", "default") != "default" or local.get("partial_rotary_factor") not in (None, 1):
        raise refuse(arch, f"rope_parameters.sliding_attention={rope['sliding_attention']}", "rescales the "
                     "windowed blocks' rotary frequencies (meshformer scales only the global blocks')")
    return {**_rope_fields(SimpleNamespace(rope_parameters=rope["full_attention"]), arch),
            "local_theta": float(local["rope_theta"]) if windowed else None}


def rope_per_layer_type_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    local_theta = cfg.rope.local_theta if cfg.rope.local_theta is not None else cfg.rope.theta
    return {"full_attention": rope_to_hf(cfg), "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


def window_from_hf(c: Any, arch: str) -> int | None:
    """HF's sliding window keeps key j for query i when i - j < sliding_window, as our attention_window does;
    Qwen2/Qwen3 use it only in the blocks from max_window_layers on (their layer_types)."""
    window = getattr(c, "sliding_window", None)
    kinds = set(getattr(c, "layer_types", None) or ["sliding_attention"])
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise refuse(arch, f"sliding_window={window} with max_window_layers={getattr(c, 'max_window_layers', None)}",
                     "mixes sliding-window and full-attention blocks (meshformer's attention_window covers all)")
    return int(window)


def full_attention_every(layer_types: list[str], arch: str) -> int | None:
    """Our full_attention_every for HF's layer_types (None: every block windowed), refusing any other pattern."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    every = full[0] + 1 if full else None
    expected = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
                for i in range(len(layer_types))]
    if layer_types != expected or set(layer_types) - {"full_attention", "sliding_attention"}:
        raise refuse(arch, f"layer_types={layer_types}", "is not every n-th block global and the others windowed "
                     "(meshformer's full_attention_every)")
    return every


def layer_types_to_hf(cfg: ModelConfig) -> list[str]:
    return ["full_attention" if cfg.window(i) is None else "sliding_attention" for i in range(cfg.n_layers)]


def check(c: Any, arch: str, hidden_act: bool = True) -> None:
    """What no Llama-like block here computes: another gated activation (where `hidden_act` says the MLP reads it),
    clamped q/k/v, sliced linears, dense blocks other than the first ones."""
    if hidden_act and c.hidden_act != "silu":
        raise refuse(arch, f"hidden_act={c.hidden_act!r}", "changes the gated MLP (meshformer gates with silu)")
    if getattr(c, "clip_qkv", None) is not None:
        raise refuse(arch, f"clip_qkv={c.clip_qkv}", "clamps the query / key / value projections")
    if getattr(c, "pretraining_tp", 1) not in (None, 1):
        raise refuse(arch, f"pretraining_tp={c.pretraining_tp}", "splits the linears into slices")
    dense = list(getattr(c, "mlp_only_layers", None) or [])
    if dense != list(range(len(dense))):
        raise refuse(arch, f"mlp_only_layers={dense}", "makes blocks other than the first ones dense (meshformer's "
                     "moe_first_dense keeps a prefix dense)")


def refuse_attention_bias(c: Any, arch: str) -> None:
    if c.attention_bias:
        raise refuse(arch, "attention_bias=True", "puts biases on the attention linears but not on the MLPs "
                     "(meshformer's model.bias covers all of them)")


def config_from_hf(c: Any, arch: str, window: bool = True, hidden_act: bool = True) -> ModelConfig:
    """The ModelConfig of what every Llama-like config gives the same way, built from its typed tables (each adapter
    then replaces what is its own); with `window`, sliding_window on every block (or none) = our attention.window;
    without `hidden_act`, the architecture's MLP ignores that key (its adapter sets the activation)."""
    check(c, arch, hidden_act)
    kv = c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    sliding = window_from_hf(c, arch) if window else None
    return ModelConfig(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        position="rope", max_seq_len=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings,
        bias=getattr(c, "attention_bias", False), layer_types=attention_pattern(sliding, None),
        attention=AttentionConfig(
            n_heads=c.num_attention_heads, n_kv_heads=None if kv in (None, c.num_attention_heads) else kv,
            head_dim=None if head_dim * c.num_attention_heads == c.hidden_size else head_dim,
            dropout=c.attention_dropout, window=sliding),
        ffn=FfnConfig(d_ff=c.intermediate_size, activation="swiglu"),
        norm=NormConfig(kind="rmsnorm", eps=c.rms_norm_eps, position="pre"),
        rope=rope_config_from_hf(c, arch), init=InitConfig(std=c.initializer_range))


def fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config arguments every Llama-like architecture takes the same way."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.attention_head_dim,
        hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm.eps,
        tie_word_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attention.dropout,
        initializer_range=cfg.init.std, rope_parameters=rope_to_hf(cfg),
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
