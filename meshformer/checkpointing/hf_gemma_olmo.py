"""Configs between meshformer and Hugging Face OLMo 2, Gemma 2 and Gemma 3 (text); their tensors use Llama's name map
with the block norms where these models put them (model/families/decoder.py). checkpointing/hf.py dispatches here.

- OLMo 2: no pre-norms; each sub-layer's output is normalised before the residual add (our
  norm_position="post_sublayer"); QK-norm over the whole q / k projection (all heads at once: qk_norm_scope=
  "projection"), before RoPE. attention_bias (on Q/K/V/O, not the MLP) is refused.
- Gemma 2 and 3: sandwich norms (pre and post each sub-layer), RMSNorm scaling by (1 + weight)
  (norm_weight_offset=1), embeddings x sqrt(d_model) rounded to the model dtype, gated GELU (tanh) MLP (our
  "geglu"), attention scale query_pre_attn_scalar^-0.5, the sliding window on every block but each
  full_attention_every-th (layer_types), final-logit soft-capping. Gemma 2 adds attention-logit soft-capping and
  one RoPE for all blocks. Gemma 3 (Gemma3ForCausalLM, model_type gemma3_text) adds the per-head QK-norm (also
  1 + weight) and RoPE per layer type: the windowed blocks' own base (rope_local_theta, unscaled) and the global
  blocks' (rope_theta, with rope scaling); it reads attn_logit_softcapping but never applies it, so import ignores
  it as transformers does and export refuses our attention_softcap. Refused: layer_types other than that pattern,
  a scaled sliding-window RoPE, use_bidirectional_attention, attention_bias, another activation.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from meshformer.config import ModelConfig
from meshformer.config.migrate import model_from_flat

OLMO2, GEMMA2, GEMMA3 = "olmo2", "gemma2", "gemma3_text"


def olmo2_from_hf(c: Any) -> ModelConfig:
    from meshformer.checkpointing.hf import _check_llama_like, _refuse, _rope_from_hf

    _check_llama_like(c, OLMO2)
    if c.attention_bias:
        raise _refuse(OLMO2, "attention_bias=True", "puts biases on the attention linears but not on the MLPs "
                      "(meshformer's model.bias covers all of them)")
    kv = c.num_key_value_heads
    return model_from_flat(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=None if kv in (None, c.num_attention_heads) else kv, n_layers=c.num_hidden_layers,
        d_ff=c.intermediate_size, activation="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps,
        norm_position="post_sublayer", qk_norm=True, qk_norm_scope="projection", position="rope",
        **_rope_from_hf(c, OLMO2), max_seq_len=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings,
        bias=False, attention_dropout=c.attention_dropout, init_std=c.initializer_range)


def _full_attention_every(layer_types: list[str], arch: str) -> int | None:
    """Our full_attention_every for HF's layer_types (None: every block windowed), refusing any other pattern."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    every = full[0] + 1 if full else None
    expected = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
                for i in range(len(layer_types))]
    if layer_types != expected or set(layer_types) - {"full_attention", "sliding_attention"}:
        from meshformer.checkpointing.hf import _refuse

        raise _refuse(arch, f"layer_types={layer_types}", "is not every n-th block global and the others windowed "
                      "(meshformer's full_attention_every)")
    return every


def gemma_from_hf(c: Any, arch: str) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text): what they share, then Gemma 3's QK-norm and RoPE per layer type."""
    from meshformer.checkpointing.hf import _refuse, _rope_from_hf

    if c.hidden_activation not in ("gelu_pytorch_tanh", "gelu_new"):
        raise _refuse(arch, f"hidden_activation={c.hidden_activation!r}", "changes the gated MLP (meshformer's "
                      "geglu gates with gelu's tanh approximation)")
    if c.attention_bias:
        raise _refuse(arch, "attention_bias=True", "puts biases on the attention linears but not on the MLPs "
                      "(meshformer's model.bias covers all of them)")
    if getattr(c, "use_bidirectional_attention", False):
        raise _refuse(arch, "use_bidirectional_attention=True", "makes attention bidirectional")
    kinds = list(c.layer_types)
    window = None if c.sliding_window is None or "sliding_attention" not in kinds else c.sliding_window
    every = _full_attention_every(kinds, arch) if window is not None else None
    if arch == GEMMA3:  # the global blocks' RoPE (maybe scaled) and the windowed blocks' own base
        rope = c.rope_parameters
        local = dict(rope["sliding_attention"])
        if local.pop("rope_type", "default") != "default":
            raise _refuse(arch, f"rope_parameters.sliding_attention={rope['sliding_attention']}", "rescales the "
                          "windowed blocks' rotary frequencies (meshformer scales only the global blocks')")
        positions = {**_rope_from_hf(SimpleNamespace(rope_parameters=rope["full_attention"]), arch),
                     "rope_local_theta": float(local["rope_theta"]) if window is not None else None}
    else:
        positions = _rope_from_hf(c, arch)
    head_dim = c.head_dim
    kv = c.num_key_value_heads
    return model_from_flat(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=None if kv in (None, c.num_attention_heads) else kv, n_layers=c.num_hidden_layers,
        head_dim=None if head_dim * c.num_attention_heads == c.hidden_size else head_dim,
        d_ff=c.intermediate_size, activation="geglu", norm="rmsnorm", norm_eps=c.rms_norm_eps,
        norm_position="sandwich", norm_weight_offset=1.0, qk_norm=arch == GEMMA3, scale_embeddings=True,
        position="rope", **positions, attention_window=window, full_attention_every=every,
        attention_scale=None if c.query_pre_attn_scalar == head_dim else c.query_pre_attn_scalar**-0.5,
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it
        attention_softcap=c.attn_logit_softcapping if arch == GEMMA2 else None,
        logit_softcap=c.final_logit_softcapping, max_seq_len=c.max_position_embeddings,
        tie_embeddings=c.tie_word_embeddings, bias=False, attention_dropout=c.attention_dropout,
        init_std=c.initializer_range)


def olmo2_to_hf(cfg: ModelConfig, shared: dict[str, Any]) -> Any:
    import transformers

    shared = {k: v for k, v in shared.items() if k != "head_dim"}  # OLMo 2: always hidden_size / heads
    return transformers.Olmo2Config(**shared, intermediate_size=cfg.ffn.d_ff, attention_bias=False)


def query_pre_attn_scalar(cfg: ModelConfig) -> int | None:
    """Gemma's attention scale as the integer whose inverse square root it is; None if it is no such integer's."""
    if cfg.attention.scale is None:
        return cfg.attention_head_dim
    scalar = round(cfg.attention.scale**-2)
    return scalar if scalar > 0 and scalar**-0.5 == cfg.attention.scale else None


def gemma_to_hf(cfg: ModelConfig, shared: dict[str, Any], arch: str) -> Any:
    import transformers

    from meshformer.checkpointing.hf import _rope_to_hf

    shared = {k: v for k, v in shared.items() if k not in ("hidden_act", "rope_parameters")}
    layer_types = ["full_attention" if cfg.window(i) is None else "sliding_attention" for i in range(cfg.n_layers)]
    common = dict(**shared, intermediate_size=cfg.ffn.d_ff, hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                  sliding_window=cfg.attention.window, layer_types=layer_types,
                  query_pre_attn_scalar=query_pre_attn_scalar(cfg), final_logit_softcapping=cfg.logit_softcap,
                  use_bidirectional_attention=False)
    if arch == GEMMA2:
        return transformers.Gemma2Config(**common, rope_parameters=_rope_to_hf(cfg),
                                         attn_logit_softcapping=cfg.attention.softcap)
    local_theta = cfg.rope.local_theta if cfg.rope.local_theta is not None else cfg.rope.theta
    return transformers.Gemma3TextConfig(**common, rope_parameters={
        "full_attention": _rope_to_hf(cfg), "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}})
