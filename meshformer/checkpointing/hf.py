"""Weights and configs between meshformer's `Transformer` and Hugging Face GPT-2, BERT, Llama, T5, Mistral, Qwen2,
Qwen3, Mixtral, Qwen3-MoE, OLMoE, OLMo 2, Gemma 2 and Gemma 3 (text; the last three's configs in hf_gemma_olmo.py).

    hf_model = to_hf_model(model)            # GPT2LMHeadModel / BertForMaskedLM / LlamaForCausalLM / T5...
    model = from_hf_model(hf_model)          # and back; logits agree (tests/unit/test_model_references.py)

The name maps read and write tensors as save_pretrained stores them (what Hub checkpoints hold); in-memory models
go through transformers' own conversion to its modules' layout (from_pretrained / revert_weight_conversion).

What differs and how it is mapped:
- GPT-2: Conv1D weights are stored (in, out), so they are transposed; `c_attn` packs q/k/v; gelu_new
  is our "gelu_tanh"; learned positions, pre-norm, final norm `ln_f`, head tied to `wte`;
  scale_attn_weights=False is our attention_scale=1.0. reorder_and_upcast_attn only computes the scores in
  fp32 (the same function); scale_attn_by_inverse_layer_idx (a per-layer scale) is refused.
- BERT: post-norm, GELU (erf), embedding LayerNorm = our `embedding_norm`, MLM transform = our
  `head_transform`, decoder bias = our `output_bias`. We have no token types: import folds
  `token_type_embeddings[0]` into the position table (exact for token_type_ids = 0, HF's default);
  export writes zero token-type embeddings. The pooler / NSP head are not part of BertForMaskedLM.
- Llama: RMSNorm, SwiGLU, half-split RoPE, grouped-query heads, untied head: names only. head_dim = ours;
  rope_parameters of rope_type linear / llama3 / yarn = our rope_scaling and rope_* keys (Llama 3.1/3.2's
  llama3); other rope types, keys we lack (yarn's mscale, partial_rotary_factor) and yarn truncate=False are
  refused; attention_bias must equal mlp_bias (our `bias` covers every linear).
- Mistral: Llama plus sliding_window = our attention_window (both keep key j for query i when i - j < window).
- Qwen2: biases on Q/K/V only = our qkv_bias=True with bias=False. Qwen2/Qwen3 use the window only in blocks
  from max_window_layers on: all or none of them maps (export writes max_window_layers=0), a mix is refused.
- Qwen3: QK-norm (one RMSNorm of width head_dim per query / key head) = our qk_norm; attention_bias=True (on
  Q/K/V/O but not the MLP) is refused.
- Mixtral / Qwen3-MoE: each expert's gate / up / down nn.Linear (out, in) (Mixtral's w1 / w3 / w2) is one slice
  of our stacked (n_experts, in, out) tensor, transposed; the router `gate` = our router. Both take the top-k
  of the softmax over all experts; Mixtral renormalises them (= a softmax over the top-k logits), Qwen3-MoE
  when norm_topk_prob (= our router_renormalize). Qwen3-MoE's decoder_sparse_step and
  mlp_only_layers become model.mlp_types when mlp_only_layers lists the first blocks (else refused); dense blocks are
  intermediate_size wide, experts moe_intermediate_size (= our d_ff, moe_d_ff). router_aux_loss_coef <->
  moe_aux_loss (a training knob, carried as is). router_jitter_noise is training-only input noise, like
  dropout, so it is not part of the function: import ignores it, export writes 0. Neither has shared experts,
  sigmoid scores, group-limited routing, capacity dropping or a selection bias: our expert_bias is zeros on
  import and a nonzero one is refused on export, the others by `check_compatible`.
- OLMoE: Qwen3-MoE's names and routing (norm_topk_prob = our router_renormalize, every block MoE, experts
  intermediate_size wide) with OLMo 2's QK-norm over the whole q / k projection (qk_norm_scope="projection"),
  pre-norm blocks, head_dim hidden_size / heads; clip_qkv (clamping q / k / v) and attention_bias are refused.
- T5: position="t5_relative" (one learned, bucketed bias per stack, which HF keeps in block 0's
  SelfAttention), RMSNorm without bias, attention_scale=1.0, scale_output for the tied head; ReLU or
  gated-SiLU feed-forward; gated-GELU (T5 v1.1) is refused. transformers 5 always ties T5's lm_head to
  `shared` (tie_word_embeddings=False only turns off the output scaling), so lm_head is an alias.
`transformers` is imported lazily: it is a development dependency.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from meshformer.checkpointing import hf_gemma_olmo
from meshformer.checkpointing.formats import ARCHS, Arch
from meshformer.checkpointing.mapping import (
    ZERO_ON_IMPORT,
    export_tensors,
    finish_import,
    import_tensors,
    name_map,
    our_shapes,
)
from meshformer.checkpointing.megatron_config import moe_every_pattern
from meshformer.config import Activation, AttentionConfig, FfnConfig, InitConfig, ModelConfig, NormConfig
from meshformer.config.migrate import get_flat, model_from_flat
from meshformer.model.families import get_family_spec

if TYPE_CHECKING:
    from meshformer.model import Transformer

V = TypeVar("V")  # what a state dict maps names to (tensors, or the names themselves)
# Llama's blocks and names, with what differs mapped below
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "olmo2", "gemma2", "gemma3_text")

_HF_ACTIVATIONS: dict[str, Activation] = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                                          "relu": "relu"}
_TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}

# Foreign tensors that carry no weights (buffers of older checkpoints), or BERT pre-training parts that
# BertForMaskedLM does not have either (pooler, next-sentence head).
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias|position_ids|token_type_ids|rotary_emb\.inv_freq)$"
                      r"|^(bert\.pooler\.|cls\.seq_relationship\.)")
# Base-model checkpoints (GPT2Model, BertModel, LlamaModel; e.g. the original "gpt2" files) lack this prefix.
_BASE_PREFIX = {"gpt2": "transformer.", "bert": "bert.", **dict.fromkeys(_LLAMA_LIKE, "model.")}


# ----------------------------------------------------------------------------- configs

# Each architecture's sizes in config.json (a key left out or null gets transformers' default), and its layer counts.
_SIZE_KEYS: dict[str, tuple[str, ...]] = {
    "gpt2": ("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_inner"),
    "bert": ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
             "max_position_embeddings"),
    "llama": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "head_dim"),
    **dict.fromkeys(("mistral", "qwen2", "qwen3"), (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "head_dim", "sliding_window")),
    "mixtral": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "head_dim", "num_local_experts",
                "num_experts_per_tok", "sliding_window"),
    "qwen3_moe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "head_dim", "num_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "decoder_sparse_step"),
    "olmo2": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings"),
    "olmoe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "num_experts", "num_experts_per_tok"),
    **dict.fromkeys(("gemma2", "gemma3_text"), (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "head_dim", "sliding_window", "query_pre_attn_scalar")),
    "t5": ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads",
           "relative_attention_num_buckets", "relative_attention_max_distance"),
}
_LAYER_KEYS = {"gpt2": ("n_layer",), "bert": ("num_hidden_layers",), "t5": ("num_layers", "num_decoder_layers"),
               **dict.fromkeys(_LLAMA_LIKE, ("num_hidden_layers",))}
_WIDTH_AND_HEADS = {"gpt2": ("n_embd", "n_head"), "bert": ("hidden_size", "num_attention_heads"),
                    "llama": ("hidden_size", "num_attention_heads"),
                    # the others may set head_dim
                    **dict.fromkeys(("olmo2", "olmoe"), ("hidden_size", "num_attention_heads"))}


def check_sizes(raw: Mapping[str, Any], n_tensors: int) -> None:
    """The sizes of a config.json, before transformers or meshformer builds anything from them: positive
    integers, and no stack deeper than the checkpoint has tensors (every layer holds some), so an absurd depth
    is refused instead of building that many layers."""
    arch = raw.get("model_type")
    for key in _SIZE_KEYS.get(arch, ()):  # type: ignore[arg-type]  # an unknown model_type is refused later
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{key}={value!r} is not a positive integer")
    for key in _LAYER_KEYS.get(arch, ()):  # type: ignore[arg-type]
        if (raw.get(key) or 0) > n_tensors:
            raise ValueError(f"{key}={raw[key]} layers, but the checkpoint holds only {n_tensors} tensors")
    width, heads = _WIDTH_AND_HEADS.get(arch, ("", ""))  # type: ignore[arg-type]
    if width in raw and heads in raw and raw[width] % raw[heads]:
        raise ValueError(f"{width}={raw[width]} is not divisible by {heads}={raw[heads]}")


def _activation(name: str, arch: str) -> Activation:
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"{arch}: activation {name!r} has no meshformer equivalent — only checkpoints using one of "
                         f"{sorted(_HF_ACTIVATIONS)} can be imported")
    return _HF_ACTIVATIONS[name]


def _refuse(arch: str, setting: str, why: str) -> ValueError:
    """A config flag that would make the imported model compute a different function than the original."""
    return ValueError(f"{arch}: {setting} {why}, which meshformer cannot express — importing it would compute "
                      "different logits; only checkpoints without it can be converted")


def _check_gpt2(c: Any) -> None:
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise _refuse("gpt2", "scale_attn_by_inverse_layer_idx=True", "divides each layer's attention scores by "
                      "its depth")
    if getattr(c, "add_cross_attention", False):
        raise _refuse("gpt2", "add_cross_attention=True", "adds cross-attention to every block")


# The rope_parameters keys each rope_type may carry (rope_theta aside), and ours for them.
# yarn's truncate: only True (the default), checked apart.
_SCALED = {"factor": "rope_scaling_factor", "original_max_position_embeddings": "rope_original_max_seq_len"}
_ROPE_KEYS = {"linear": {"factor": "rope_scaling_factor"},
              "llama3": {**_SCALED, "low_freq_factor": "rope_low_freq_factor",
                         "high_freq_factor": "rope_high_freq_factor"},
              "yarn": {**_SCALED, "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow",
                       "attention_factor": "rope_attention_factor", "truncate": ""}}


def _rope_from_hf(c: Any, arch: str) -> dict[str, Any]:
    """Our rope_* keys for HF's rope_parameters (transformers 5; rope_scaling in older configs)."""
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    fields: dict[str, Any] = {"rope_theta": float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))}
    if kind == "default":
        return fields
    if kind not in _ROPE_KEYS:
        raise _refuse(arch, f"rope_type={kind!r}", "rescales the rotary frequencies its own way")
    if rope.get("truncate", True) is not True:
        raise _refuse(arch, "rope_parameters.truncate=False", "widens yarn's frequency ramp to fractional dimensions")
    for key, value in rope.items():
        if key not in _ROPE_KEYS[kind] and value is not None:
            raise _refuse(arch, f"rope_parameters.{key}={value!r}", f"changes {kind} frequency scaling")
    return {**fields, "rope_scaling": kind, **{ours: rope[key] for key, ours in _ROPE_KEYS[kind].items()
                                               if ours and rope.get(key) is not None}}


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default" if cfg.rope.scaling == "none" else cfg.rope.scaling,
                            "rope_theta": cfg.rope.theta}
    for key, ours in _ROPE_KEYS.get(cfg.rope.scaling, {}).items():
        if ours and get_flat(cfg, ours) is not None:
            rope[key] = get_flat(cfg, ours)
    return rope


def _window_from_hf(c: Any, arch: str) -> int | None:
    """HF's sliding window keeps key j for query i when i - j < sliding_window, as our attention_window does;
    Qwen2/Qwen3 use it only in the blocks from max_window_layers on (their layer_types)."""
    window = getattr(c, "sliding_window", None)
    kinds = set(getattr(c, "layer_types", None) or ["sliding_attention"])
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise _refuse(arch, f"sliding_window={window} with max_window_layers={getattr(c, 'max_window_layers', None)}",
                      "mixes sliding-window and full-attention blocks (meshformer's attention_window covers all)")
    return int(window)


def _check_llama_like(c: Any, arch: str) -> None:
    if c.hidden_act != "silu":
        raise _refuse(arch, f"hidden_act={c.hidden_act!r}", "changes the gated MLP (meshformer gates with silu)")
    if arch == "llama" and c.attention_bias != getattr(c, "mlp_bias", c.attention_bias):
        raise _refuse(arch, f"attention_bias={c.attention_bias} with mlp_bias={c.mlp_bias}",
                      "puts biases on only some linears (meshformer's model.bias covers all of them)")
    if arch in ("qwen3", "qwen3_moe", "olmoe") and c.attention_bias:
        raise _refuse(arch, "attention_bias=True", "puts biases on the attention linears but not on the MLPs "
                      "(meshformer's model.bias covers all of them)")
    if getattr(c, "clip_qkv", None) is not None:
        raise _refuse(arch, f"clip_qkv={c.clip_qkv}", "clamps the query / key / value projections")
    if getattr(c, "pretraining_tp", 1) not in (None, 1):
        raise _refuse(arch, f"pretraining_tp={c.pretraining_tp}", "splits the linears into slices")
    dense = list(getattr(c, "mlp_only_layers", None) or [])
    if dense != list(range(len(dense))):
        raise _refuse(arch, f"mlp_only_layers={dense}", "makes blocks other than the first ones dense (meshformer's "
                      "import keeps a prefix dense)")


def _llama_like_from_hf(c: Any, arch: str) -> ModelConfig:
    """Llama, Mistral, Qwen2, Qwen3, Mixtral and Qwen3-MoE: what they share, then what each adds (rotary
    scaling, sliding window, Q/K/V biases, QK-norm, experts)."""
    _check_llama_like(c, arch)
    kv = c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    fields: dict[str, Any] = dict(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=None if kv in (None, c.num_attention_heads) else kv, n_layers=c.num_hidden_layers,
        head_dim=None if head_dim * c.num_attention_heads == c.hidden_size else head_dim,
        d_ff=c.intermediate_size, activation="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps, norm_position="pre",
        position="rope", **_rope_from_hf(c, arch), max_seq_len=c.max_position_embeddings,
        tie_embeddings=c.tie_word_embeddings, bias=getattr(c, "attention_bias", False),
        attention_dropout=c.attention_dropout, init_std=c.initializer_range, attention_window=_window_from_hf(c, arch),
    )
    if arch == "qwen2":  # biases on Q/K/V only, always
        fields.update(qkv_bias=True)
    if arch == "qwen3":
        fields.update(qk_norm=True)
    if arch == "mixtral":  # every block MoE; top-k of the softmax, renormalised (= softmax over the top-k logits)
        # router_jitter_noise is training-only input noise, like dropout: not part of the function, not carried
        fields.update(n_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok,
                      router_renormalize=True, moe_aux_loss=c.router_aux_loss_coef)
    if arch == "olmoe":  # QK-norm over the whole projections; head_dim is always hidden_size / heads
        fields.update(qk_norm=True, qk_norm_scope="projection", head_dim=None, n_experts=c.num_experts,
                      experts_per_token=c.num_experts_per_tok, router_renormalize=c.norm_topk_prob,
                      moe_aux_loss=c.router_aux_loss_coef)
    if arch == "qwen3_moe":
        fields.update(qk_norm=True, n_experts=c.num_experts, experts_per_token=c.num_experts_per_tok,
                      moe_d_ff=c.moe_intermediate_size, router_renormalize=c.norm_topk_prob,
                      moe_every=c.decoder_sparse_step, moe_first_dense=len(c.mlp_only_layers or []),
                      moe_aux_loss=c.router_aux_loss_coef)
    return model_from_flat(**fields)


def config_from_hf(hf_config: Any) -> ModelConfig:
    """The meshformer ModelConfig computing the same function as an HF config of one of `ARCHS`."""
    arch, c = hf_config.model_type, hf_config
    if arch == "gpt2":
        _check_gpt2(c)
        return ModelConfig(family="decoder", vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer,
                           position="learned", max_seq_len=c.n_positions, tie_embeddings=c.tie_word_embeddings,
                           bias=True, dropout=c.resid_pdrop,
                           attention=AttentionConfig(n_heads=c.n_head, dropout=c.attn_pdrop,
                                                     scale=None if getattr(c, "scale_attn_weights", True) else 1.0),
                           ffn=FfnConfig(d_ff=c.n_inner or 4 * c.n_embd,
                                         activation=_activation(c.activation_function, arch)),
                           norm=NormConfig(kind="layernorm", eps=c.layer_norm_epsilon, position="pre"),
                           init=InitConfig(std=c.initializer_range))
    if arch == "bert":
        position = getattr(c, "position_embedding_type", None) or "absolute"
        if position != "absolute":
            raise _refuse("bert", f"position_embedding_type={position!r}", "uses relative position scores")
        if c.is_decoder or getattr(c, "add_cross_attention", False):
            raise _refuse("bert", "is_decoder/add_cross_attention", "makes attention causal or adds cross-attention")
        return ModelConfig(family="encoder", vocab_size=c.vocab_size, d_model=c.hidden_size,
                           n_layers=c.num_hidden_layers, head_transform=True, output_bias=True, position="learned",
                           max_seq_len=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings, bias=True,
                           dropout=c.hidden_dropout_prob,
                           attention=AttentionConfig(n_heads=c.num_attention_heads,
                                                     dropout=c.attention_probs_dropout_prob),
                           ffn=FfnConfig(d_ff=c.intermediate_size, activation=_activation(c.hidden_act, arch)),
                           norm=NormConfig(kind="layernorm", eps=c.layer_norm_eps, position="post", final=False,
                                           embedding=True), init=InitConfig(std=c.initializer_range))
    if arch == "olmo2":
        return hf_gemma_olmo.olmo2_from_hf(c)
    if arch in ("gemma2", "gemma3_text"):
        return hf_gemma_olmo.gemma_from_hf(c, arch)
    if arch in _LLAMA_LIKE:
        return _llama_like_from_hf(c, arch)
    if arch == "t5":
        if c.d_kv * c.num_heads != c.d_model:
            raise ValueError("t5: d_kv * num_heads must equal d_model")
        if c.dense_act_fn != ("silu" if c.is_gated_act else "relu"):
            raise ValueError(f"t5: feed_forward_proj {c.feed_forward_proj!r} unsupported (use 'relu' or 'gated-silu'; "
                             "T5 v1.1's gated-gelu gates with gelu_new, meshformer's swiglu with silu)")
        return ModelConfig(family="encoder_decoder", vocab_size=c.vocab_size, d_model=c.d_model,
                           n_encoder_layers=c.num_layers, n_decoder_layers=c.num_decoder_layers, position="t5_relative",
                           scale_output=c.scale_decoder_outputs, tie_embeddings=True, share_embeddings=True, bias=False,
                           dropout=c.dropout_rate,
                           attention=AttentionConfig(n_heads=c.num_heads,
                                                     relative_buckets=c.relative_attention_num_buckets,
                                                     relative_max_distance=c.relative_attention_max_distance,
                                                     scale=1.0),
                           ffn=FfnConfig(d_ff=c.d_ff, activation="swiglu" if c.is_gated_act else "relu"),
                           norm=NormConfig(kind="rmsnorm", eps=c.layer_norm_epsilon, position="pre", final=True))
    raise ValueError(f"unsupported Hugging Face model_type {arch!r}; supported: {list(ARCHS)}")


def config_to_hf(cfg: ModelConfig, arch: Arch | None = None) -> Any:
    """A transformers config for `cfg` (checked with `check_compatible` first)."""
    import transformers

    arch = arch or infer_arch(cfg)
    check_compatible(cfg, arch)
    if arch == "gpt2":
        special = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
            n_head=cfg.attention.n_heads, n_inner=cfg.ffn.d_ff,
            activation_function=_TO_HF_ACTIVATION[cfg.ffn.activation],
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention.dropout,
            layer_norm_epsilon=cfg.norm.eps, initializer_range=cfg.init.std, bos_token_id=special,
            eos_token_id=special, tie_word_embeddings=cfg.tie_embeddings,
            scale_attn_weights=_features(cfg)["attention_scale"] != 1.0,
        )
    if arch == "bert":
        return transformers.BertConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.attention.n_heads, intermediate_size=cfg.ffn.d_ff,
            hidden_act=_TO_HF_ACTIVATION[cfg.ffn.activation], hidden_dropout_prob=cfg.dropout,
            attention_probs_dropout_prob=cfg.attention.dropout, max_position_embeddings=cfg.max_seq_len,
            layer_norm_eps=cfg.norm.eps, initializer_range=cfg.init.std, tie_word_embeddings=cfg.tie_embeddings,
            pad_token_id=0,
        )
    if arch in _LLAMA_LIKE:
        shared: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.attention_head_dim,
            hidden_act="silu", max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm.eps,
            tie_word_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attention.dropout,
            initializer_range=cfg.init.std, rope_parameters=_rope_to_hf(cfg),
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        # Qwen2/Qwen3: the window in every block (from max_window_layers = 0 on)
        qwen_window: dict[str, Any] = dict(use_sliding_window=cfg.attention.window is not None,
                                           sliding_window=cfg.attention.window, max_window_layers=0)
        if arch == "olmo2":
            return hf_gemma_olmo.olmo2_to_hf(cfg, shared)
        if arch in ("gemma2", "gemma3_text"):
            return hf_gemma_olmo.gemma_to_hf(cfg, shared, arch)
        if arch == "mistral":
            return transformers.MistralConfig(**shared, intermediate_size=cfg.ffn.d_ff,
                                              sliding_window=cfg.attention.window)
        if arch == "qwen2":
            return transformers.Qwen2Config(**shared, **qwen_window, intermediate_size=cfg.ffn.d_ff)
        if arch == "qwen3":
            return transformers.Qwen3Config(**shared, **qwen_window, intermediate_size=cfg.ffn.d_ff,
                                            attention_bias=False)
        if arch == "mixtral":
            return transformers.MixtralConfig(
                **shared, intermediate_size=cfg.expert_d_ff, sliding_window=cfg.attention.window,
                num_local_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
                router_aux_loss_coef=cfg.moe.aux_loss, router_jitter_noise=0.0,
            )
        if arch == "qwen3_moe":
            first_dense, every = moe_every_pattern([cfg.is_moe(i) for i in range(cfg.n_layers)])
            return transformers.Qwen3MoeConfig(
                **shared, intermediate_size=cfg.ffn.d_ff, moe_intermediate_size=cfg.expert_d_ff,
                use_sliding_window=cfg.attention.window is not None, sliding_window=cfg.attention.window,
                num_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
                norm_topk_prob=cfg.moe.router_renormalize, decoder_sparse_step=every,
                mlp_only_layers=list(range(first_dense)), router_aux_loss_coef=cfg.moe.aux_loss,
                attention_bias=False,
            )
        if arch == "olmoe":
            shared.pop("head_dim")  # always hidden_size / heads
            return transformers.OlmoeConfig(
                **shared, intermediate_size=cfg.expert_d_ff, num_experts=cfg.moe.n_experts,
                num_experts_per_tok=cfg.moe.experts_per_token, norm_topk_prob=cfg.moe.router_renormalize,
                router_aux_loss_coef=cfg.moe.aux_loss, attention_bias=False, clip_qkv=None,
            )
        return transformers.LlamaConfig(**shared, intermediate_size=cfg.ffn.d_ff, attention_bias=cfg.bias,
                                        mlp_bias=cfg.bias)
    spec = get_family_spec(cfg.family)
    return transformers.T5Config(  # type: ignore[call-arg]  # tie_word_embeddings: a PretrainedConfig kwarg
        vocab_size=cfg.vocab_size, d_model=cfg.d_model, d_kv=cfg.attention_head_dim, d_ff=cfg.ffn.d_ff,
        num_layers=spec.depth(cfg, "encoder"), num_decoder_layers=spec.depth(cfg, "decoder"),
        num_heads=cfg.attention.n_heads,
        dropout_rate=cfg.dropout, layer_norm_epsilon=cfg.norm.eps,
        relative_attention_num_buckets=cfg.attention.relative_buckets,
        relative_attention_max_distance=cfg.attention.relative_max_distance,
        feed_forward_proj="gated-silu" if cfg.ffn.activation == "swiglu" else "relu",
        tie_word_embeddings=cfg.scale_output,  # T5Config turns this into scale_decoder_outputs
    )


def _full_attention_every(cfg: ModelConfig) -> int | str | None:
    """k when every k-th block attends globally and the others through the window (None: every block windowed;
    "other": another pattern of model.layer_types)."""
    types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
    if "full_attention" not in types:
        return None
    every = types.index("full_attention") + 1
    return every if [(i + 1) % every == 0 for i in range(cfg.n_layers)] == [t == "full_attention" for t in types] \
        else "other"


def _features(cfg: ModelConfig) -> dict[str, Any]:
    """The config facts an architecture constrains, normalised (e.g. default attention scale, GQA or not)."""
    default_scale = cfg.attention.scale is None or math.isclose(cfg.attention.scale, cfg.attention_head_dim**-0.5)
    default_head_dim = cfg.attention_head_dim * cfg.attention.n_heads == cfg.d_model
    moe = cfg.moe.n_experts > 0
    return {
        # MoE: the router settings only matter where there are experts
        "moe": moe, "n_shared_experts": cfg.moe.n_shared_experts if moe else 0,
        "router_score": cfg.moe.router_score if moe else "softmax",
        "router_renormalize": cfg.moe.router_renormalize if moe else True,
        "router_groups": cfg.moe.router_groups if moe else 1,
        "capacity_factor": cfg.moe.capacity_factor if moe else 0.0,
        "moe_blocks": "every block" if not moe or all(cfg.is_moe(i) for i in range(cfg.n_layers)) else "some",
        "family": cfg.family, "norm": cfg.norm.kind, "norm_position": cfg.norm.position,
        "final_norm": cfg.use_final_norm,
        "embedding_norm": cfg.norm.embedding, "position": cfg.position, "scale_embeddings": cfg.scale_embeddings,
        "tie_embeddings": cfg.tie_embeddings, "share_embeddings": cfg.share_embeddings, "bias": cfg.bias,
        "head_transform": cfg.head_transform, "output_bias": cfg.output_bias, "activation": cfg.ffn.activation,
        "grouped_query": cfg.kv_heads != cfg.attention.n_heads, "attention_window": cfg.attention.window,
        "attention_scale": "1/sqrt(head_dim)" if default_scale else cfg.attention.scale,
        "scale_output": cfg.scale_output, "cross_downsample": cfg.cross_downsample,
        "rope_scaling": cfg.rope.scaling, "head_dim": "d_model/n_heads" if default_head_dim else cfg.attention.head_dim,
        "qk_norm": cfg.attention.qk_norm, "qkv_bias": "as bias" if cfg.use_qkv_bias == cfg.bias else cfg.use_qkv_bias,
        "qk_norm_scope": cfg.attention.qk_norm_scope if cfg.attention.qk_norm else "head",
        "norm_weight_offset": cfg.norm.weight_offset,
        "full_attention_every": _full_attention_every(cfg) if cfg.attention.window is not None else None,
        "rope_local_theta": cfg.rope.local_theta if cfg.attention.window is not None else None,
        "attention_softcap": cfg.attention.softcap, "logit_softcap": cfg.logit_softcap,
        "query_pre_attn_scalar": "integer" if hf_gemma_olmo.query_pre_attn_scalar(cfg) else "none",
        # without their own base, windowed blocks rotate with the global (maybe scaled) RoPE
        "windowed_blocks_rope": "scaled (rope_scaling without rope_local_theta)" if cfg.attention.window is not None
        and cfg.rope.local_theta is None and cfg.rope.scaling != "none" else "unscaled",
    }


_COMMON = {"scale_embeddings": False, "attention_window": None, "attention_scale": "1/sqrt(head_dim)",
           "scale_output": False, "cross_downsample": 1, "embedding_norm": False, "head_transform": False,
           "output_bias": False, "grouped_query": False, "norm": "layernorm", "norm_position": "pre",
           "final_norm": True, "rope_scaling": "none", "head_dim": "d_model/n_heads", "qk_norm": False,
           "qkv_bias": "as bias", "moe": False, "n_shared_experts": 0, "router_score": "softmax",
           "router_renormalize": True, "router_groups": 1, "capacity_factor": 0.0, "moe_blocks": "every block",
           "qk_norm_scope": "head", "norm_weight_offset": 0.0, "full_attention_every": None, "rope_local_theta": None,
           "attention_softcap": None, "logit_softcap": None}
ANY = "any value"  # a requirement that every value meets
_LLAMA = {**_COMMON, "family": "decoder", "position": "rope", "norm": "rmsnorm", "activation": "swiglu",
          "grouped_query": {False, True}, "head_dim": ANY, "rope_scaling": ANY}
# attention_scale = query_pre_attn_scalar^-0.5 (an integer)
_GEMMA2 = {**_LLAMA, "bias": False, "activation": "geglu", "norm_position": "sandwich", "norm_weight_offset": 1.0,
           "scale_embeddings": True, "attention_scale": ANY, "query_pre_attn_scalar": "integer",
           "attention_window": ANY, "full_attention_every": ANY, "attention_softcap": ANY, "logit_softcap": ANY}
_REQUIREMENTS: dict[str, dict[str, Any]] = {  # a set: any of these values
    "gpt2": {**_COMMON, "family": "decoder", "position": "learned", "bias": True,
             "activation": {"gelu_tanh", "gelu", "relu"}, "attention_scale": {"1/sqrt(head_dim)", 1.0}},
    "bert": {**_COMMON, "family": "encoder", "position": "learned", "bias": True, "norm_position": "post",
             "final_norm": False, "embedding_norm": True, "head_transform": True, "output_bias": True,
             "activation": {"gelu_tanh", "gelu", "relu"}},
    "llama": _LLAMA,
    "mistral": {**_LLAMA, "bias": False, "attention_window": ANY},
    "qwen2": {**_LLAMA, "bias": False, "qkv_bias": True, "attention_window": ANY},
    "qwen3": {**_LLAMA, "bias": False, "qk_norm": True, "attention_window": ANY},
    "mixtral": {**_LLAMA, "bias": False, "moe": True, "attention_window": ANY},
    "qwen3_moe": {**_LLAMA, "bias": False, "moe": True, "attention_window": ANY, "qk_norm": True,
                  "router_renormalize": {True, False}, "moe_blocks": {"every block", "some"}},
    "olmoe": {**_LLAMA, "bias": False, "moe": True, "qk_norm": True, "qk_norm_scope": "projection",
              "head_dim": "d_model/n_heads", "router_renormalize": {True, False}},
    "olmo2": {**_LLAMA, "bias": False, "norm_position": "post_sublayer", "qk_norm": True,
              "qk_norm_scope": "projection", "head_dim": "d_model/n_heads"},
    "gemma2": _GEMMA2,
    # its sliding blocks always rotate unscaled (rope_parameters.sliding_attention)
    "gemma3_text": {**_GEMMA2, "qk_norm": True, "attention_softcap": None, "rope_local_theta": ANY,
                    "windowed_blocks_rope": "unscaled"},
    "t5": {**_COMMON, "family": "encoder_decoder", "position": "t5_relative", "norm": "rmsnorm", "bias": False,
           "tie_embeddings": True, "share_embeddings": True, "attention_scale": 1.0, "scale_output": {False, True},
           "activation": {"relu", "swiglu"}},
}


def incompatibilities(cfg: ModelConfig, arch: Arch) -> list[str]:
    """What keeps `cfg` from being expressed as `arch`, one 'key=value (needs ...)' line each."""
    have = _features(cfg)
    problems = []
    for key, need in _REQUIREMENTS[arch].items():
        if need == ANY:
            continue
        allowed = need if isinstance(need, set) else {need}
        if have[key] not in allowed:
            problems.append(f"{key}={have[key]!r} (needs {' or '.join(map(repr, sorted(allowed, key=str)))})")
    return problems


def check_compatible(cfg: ModelConfig, arch: Arch) -> None:
    problems = incompatibilities(cfg, arch)
    if problems:
        raise ValueError(f"this model cannot be expressed as {arch}: " + ", ".join(problems))


def infer_arch(cfg: ModelConfig) -> Arch:
    reasons = {arch: incompatibilities(cfg, arch) for arch in ARCHS}
    for arch, problems in reasons.items():
        if not problems:
            return arch
    raise ValueError("no Hugging Face architecture matches this config: "
                     + " | ".join(f"{a}: {'; '.join(p)}" for a, p in reasons.items()))


_BERT_POSITIONS = "bert.embeddings.position_embeddings.weight"
_BERT_TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"


# ----------------------------------------------------------------------------- state dicts


def to_hf_state_dict(model: Transformer, arch: Arch | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors for a meshformer `Transformer` (tied duplicates included, as HF state dicts have them)."""
    cfg: ModelConfig = model.cfg
    arch = arch or infer_arch(cfg)
    check_compatible(cfg, arch)
    ours = model.state_dict()
    check_exportable(ours, arch)
    out = export_tensors(ours, name_map(cfg, arch))
    if arch == "bert":
        positions = ours["pos_embeddings.weight"].detach()
        out[_BERT_POSITIONS] = positions
        out[_BERT_TOKEN_TYPES] = positions.new_zeros(2, cfg.d_model)  # BertConfig's type_vocab_size
    return out


def check_exportable(state: Mapping[str, torch.Tensor], arch: Arch) -> None:
    """Values no Hugging Face architecture here can hold: a nonzero expert selection bias (DeepSeek-V3's
    auxiliary-loss-free balancing shifts which experts a token picks; these routers have no such term)."""
    for name in state:
        if ZERO_ON_IMPORT.search(name) and state[name].any():
            raise ValueError(f"{arch}: {name} is nonzero (a selection bias from model.moe.router_bias_update_rate, "
                             f"which {arch} has no place for: without it the model would pick other experts); only "
                             "a model trained without bias balancing can be converted")


def _normalize_names(hf_state: Mapping[str, V], arch: Arch) -> Mapping[str, V]:
    """Names as the *ForCausalLM / *ForMaskedLM models of transformers 5 use them."""
    prefix = _BASE_PREFIX.get(arch)
    if prefix and not any(k.startswith(prefix) for k in hf_state):
        hf_state = {(k if k.startswith(("lm_head.", "cls.")) else prefix + k): v for k, v in hf_state.items()}
    if arch == "bert":  # TF-era BERT checkpoints call LayerNorm parameters gamma / beta
        old_names = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}
        hf_state = {re.sub(r"LayerNorm\.(gamma|beta)$", lambda m: old_names[m.group(0)], k): v
                    for k, v in hf_state.items()}
    return hf_state


def from_hf_state_dict(hf_state: Mapping[str, torch.Tensor], cfg: ModelConfig, arch: Arch) -> dict[str, torch.Tensor]:
    """Our state dict (strict-loadable into `Transformer(cfg)`) from an HF state dict of `arch`.

    Accepts the LM-head model's names and base-model checkpoints (no "transformer."/"bert."/"model." prefix,
    BERT's gamma/beta). Every HF tensor must be used: anything with no counterpart raises instead of being
    dropped, except weightless buffers and BERT's pooler / next-sentence head.
    """
    check_compatible(cfg, arch)
    hf_state = _normalize_names(hf_state, arch)
    shapes = our_shapes(cfg)
    out, used = import_tensors(hf_state, name_map(cfg, arch), shapes, f"Hugging Face {arch}")
    if arch == "bert":
        token_type = hf_state[_BERT_TOKEN_TYPES][0] if _BERT_TOKEN_TYPES in hf_state else 0.0
        out["pos_embeddings.weight"] = (hf_state[_BERT_POSITIONS] + token_type).contiguous()
    return finish_import(out, cfg, shapes, unused_names(hf_state, used, arch), f"Hugging Face {arch}")


def unused_names(names: Iterable[str], used: set[str], arch: Arch) -> list[str]:
    """HF names no rule reads, other than weightless buffers and parts BertForMaskedLM lacks too (`_IGNORED`);
    BERT's position and token-type tables are read together into our positions."""
    used = used | ({_BERT_POSITIONS, _BERT_TOKEN_TYPES} if arch == "bert" else set())
    return [k for k in names if k not in used and not _IGNORED.search(k)]


_MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM", "llama": "LlamaForCausalLM",
                  "t5": "T5ForConditionalGeneration", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def to_hf_model(model: Transformer, arch: Arch | None = None) -> Any:
    """A Hugging Face model (in `model`'s dtype and train/eval mode) holding copies of its weights.

    Loaded by transformers' own from_pretrained from the checkpoint-named tensors, so its conversions to the
    modules' layout apply exactly as for a folder (e.g. Mixtral's per-expert linears into one fused tensor)."""
    import transformers

    arch = arch or infer_arch(model.cfg)
    state = to_hf_state_dict(model, arch)
    hf_model, info = getattr(transformers, _MODEL_CLASSES[arch]).from_pretrained(
        None, config=config_to_hf(model.cfg, arch), state_dict=state, output_loading_info=True,
        dtype=next(iter(state.values())).dtype)
    problems = {kind: names for kind, names in info.items() if names}
    if problems:  # a bug in our name maps: transformers would leave such weights random or drop them
        raise ValueError(f"transformers did not load the exported {arch} tensors exactly: {problems}")
    return hf_model.train(model.training)


def from_hf_model(hf_model: Any) -> Transformer:
    """A meshformer `Transformer` computing what a GPT2LMHeadModel/BertForMaskedLM/LlamaForCausalLM/T5/
    MixtralForCausalLM/Qwen3MoeForCausalLM computes."""
    from transformers.core_model_loading import revert_weight_conversion

    from meshformer.model import Transformer

    cfg = config_from_hf(hf_model.config)
    # the tensors as save_pretrained writes them (checkpoint names and layout), which is what the name maps read
    hf_state = revert_weight_conversion(hf_model, dict(hf_model.state_dict()))
    state = from_hf_state_dict(hf_state, cfg, hf_model.config.model_type)
    model = Transformer(cfg).to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=True)
    return model.train(hf_model.training)
