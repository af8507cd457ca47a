"""Parameter counts and training FLOPs straight from a `ModelConfig`, without building the model.

`count_params(cfg)["total"]` equals `sum(p.numel() for p in Transformer(cfg).parameters())` (tied
tensors once), and `flops_per_token` is the PaLM / Megatron-LM formula used for MFU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshformer.model.config import ModelConfig
from meshformer.model.moe import is_moe_block

if TYPE_CHECKING:
    from meshformer.model.families.spec import FamilySpec


def _family(cfg: ModelConfig) -> FamilySpec:
    from meshformer.model.families import get_family_spec  # the specs point back at this module's formulas

    return get_family_spec(cfg.family)


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _norm(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm.kind == "layernorm" and cfg.bias else 1)  # RMSNorm has no bias


def _mla_matmuls(cfg: ModelConfig) -> dict[str, int]:
    """Multi-head latent attention's weights (no biases): the query path and output; the latent and rotary key's
    down-projection and the keys' and values' expansion (one per token: each token's latent is expanded once)."""
    m, d, heads = cfg.mla, cfg.d_model, cfg.attention.n_heads
    q = d * heads * m.qk_head_dim if m.q_lora_rank is None else (d + heads * m.qk_head_dim) * m.q_lora_rank
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return {"q_o": q + heads * m.v_head_dim * d, "k_v": kv}


def _mla(cfg: ModelConfig) -> int:
    """Multi-head latent attention's parameters: its matmul weights, the latent norms, biases (model.bias) on the
    down-projections and the output."""
    m = cfg.mla
    norms = m.kv_lora_rank + (m.q_lora_rank or 0)
    biases = (m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 0) + cfg.d_model) if cfg.bias else 0
    return sum(_mla_matmuls(cfg).values()) + norms + biases


def _score_widths(cfg: ModelConfig) -> int:
    """Query-key plus value widths over all heads: per query and key, QK^T and AV cost 2 FLOPs per unit of each."""
    if cfg.uses_mla:
        return cfg.attention.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
    return 2 * cfg.attention.n_heads * cfg.attention_head_dim


def _attention_matmuls(cfg: ModelConfig) -> dict[str, int]:
    """Weights (no biases) of the four projections, keyed by what they read: queries/outputs or keys/values."""
    if cfg.uses_mla:
        return _mla_matmuls(cfg)
    head = cfg.attention_head_dim
    d, q_dim, kv_dim = cfg.d_model, cfg.attention.n_heads * head, cfg.kv_heads * head
    return {"q_o": 2 * d * q_dim, "k_v": 2 * d * kv_dim}


def _attention(cfg: ModelConfig) -> int:
    if cfg.uses_mla:
        return _mla(cfg)
    head = cfg.attention_head_dim
    d, q_dim, kv_dim = cfg.d_model, cfg.attention.n_heads * head, cfg.kv_heads * head
    # one RMSNorm weight each for queries and keys: per head (shared by the heads) or over the whole projection
    per_head = cfg.attention.qk_norm_scope == "head"
    qk_norm = 0 if not cfg.attention.qk_norm else 2 * cfg.attention_head_dim if per_head else q_dim + kv_dim
    qkv_bias = cfg.use_qkv_bias
    sinks = cfg.attention.n_heads if cfg.attention.sinks else 0  # one logit per head
    return (_linear(d, q_dim, qkv_bias) + 2 * _linear(d, kv_dim, qkv_bias) + _linear(q_dim, d, cfg.bias) + qk_norm
            + sinks)


def _dense_ffn_matmuls(cfg: ModelConfig, width: int) -> int:
    return (3 if cfg.gated else 2) * cfg.d_model * width


def _dense_ffn(cfg: ModelConfig, width: int) -> int:
    if not width:
        return 0
    gate = _linear(cfg.d_model, width, cfg.bias) if cfg.gated else 0
    return gate + _linear(cfg.d_model, width, cfg.bias) + _linear(width, cfg.d_model, cfg.bias)


def _ffn_matmuls(cfg: ModelConfig, index: int) -> int:
    """Matmul weights one token passes through in the feed-forward of block `index`: an MoE block's router, its
    experts_per_token routed experts and its shared experts."""
    if not is_moe_block(cfg, index):
        return _dense_ffn_matmuls(cfg, cfg.ffn.d_ff)
    experts = cfg.moe.experts_per_token + cfg.moe.n_shared_experts
    return cfg.moe.n_experts * cfg.d_model + experts * _dense_ffn_matmuls(cfg, cfg.expert_d_ff)


def _stack_ffn_matmuls(cfg: ModelConfig, n_layers: int) -> int:
    return sum(_ffn_matmuls(cfg, i) for i in range(n_layers))


def _ffn(cfg: ModelConfig, index: int) -> tuple[int, int]:
    """(all, active) parameters of the feed-forward of block `index`; active: those one token uses (the router,
    experts_per_token routed experts, the shared experts), with the router's and experts' biases where present."""
    if not is_moe_block(cfg, index):
        dense = _dense_ffn(cfg, cfg.ffn.d_ff)
        return dense, dense
    expert = _dense_ffn_matmuls(cfg, cfg.expert_d_ff)
    if cfg.moe.expert_bias_terms:  # gate (if any) and up biases of width expert_d_ff, a down bias of width d_model
        expert += (2 if cfg.gated else 1) * cfg.expert_d_ff + cfg.d_model
    router = cfg.moe.n_experts * (cfg.d_model + int(cfg.moe.router_bias))
    common = router + _dense_ffn(cfg, cfg.moe.n_shared_experts * cfg.expert_d_ff)
    return common + cfg.moe.n_experts * expert, common + cfg.moe.experts_per_token * expert


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of `Transformer(cfg)`.

    embedding: lookup tables (token, separate source, learned positions, T5 relative biases) plus a tied output
        projection, which is the same tensor. They cost no matmul FLOPs as lookups (Kaplan et al.'s N
        excludes them).
    non_embedding: everything else = total - embedding, including an untied output projection.
    attention / feed_forward / norms / head: a breakdown of non_embedding (head = BERT head transform,
        untied output projection, output bias; attention includes its QK-norm weights);
        embedding + attention + feed_forward + norms + head = total.
    active: the parameters one token uses: total less the routed experts an MoE block does not pick for it
        (= total for a dense model).
    """
    d, vocab = cfg.d_model, cfg.vocab_size
    spec = _family(cfg)
    stacks = [(stack.count(cfg), stack.cross) for stack in spec.stacks]
    embedding = vocab * d
    if spec.seq2seq and not cfg.share_embeddings:
        embedding += vocab * d
    if cfg.position == "learned":
        embedding += cfg.max_seq_len * d
    if cfg.position == "t5_relative":  # one (buckets, heads) bias table per stack
        tables = int(spec.has_encoder) + int(spec.has_decoder)
        embedding += tables * cfg.attention.relative_buckets * cfg.attention.n_heads
    attention = sum(n * (2 if cross else 1) for n, cross in stacks) * _attention(cfg)  # + cross-attention
    ffn = [_ffn(cfg, i) for n, _ in stacks for i in range(n)]
    feed_forward = sum(all_ for all_, _ in ffn)
    inactive = feed_forward - sum(active for _, active in ffn)
    stack_norms = len(stacks) if cfg.use_final_norm else 0
    sublayers = sum(n * (3 if cross else 2) for n, cross in stacks)
    norms_per_block = sublayers * (2 if cfg.norm.position == "sandwich" else 1)
    norms = (norms_per_block + stack_norms + int(cfg.norm.embedding)) * _norm(cfg)
    head = 0
    if cfg.head_transform:
        head += _linear(d, d, cfg.bias) + _norm(cfg)
    if not cfg.tie_embeddings:
        head += vocab * d
    if cfg.output_bias:
        head += vocab
    total = embedding + attention + feed_forward + norms + head
    return {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "attention": attention,
        "feed_forward": feed_forward,
        "norms": norms,
        "head": head,
        "active": total - inactive,
    }


def _keys_per_query(cfg: ModelConfig, length: int, causal: bool, n_layers: int) -> int:
    """Keys each query scores against, summed over a stack's n_layers blocks (each with its own window or none).
    Causal attention is not halved (PaLM's convention: dense kernels)."""
    total = 0
    for block in range(n_layers):
        window = cfg.window(block)
        total += length if window is None else min(length, window if causal else 2 * window - 1)
    return total


def training_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    """Training FLOPs (forward + backward = 3 x forward) for one sequence (or source/target pair).

    Matmuls cost 2 FLOPs per weight per token forward. Per sequence of T tokens and per layer,
    attention adds QK^T and AV: 2 * 2 * T * keys * (n_heads * head_dim). Counted: every attention and
    FFN projection, the BERT head transform and the output projection over every position (the head
    matmul is counted, as in PaLM and Megatron-LM, tied or not); an MoE block counts its router and the experts
    one token passes (experts_per_token routed + the shared ones). Not counted: embedding lookups, norms,
    biases, activations, softmax, position encodings (each O(T * d), negligible). Each family's spec
    names its formula: `decoder_flops`, `encoder_flops` or `encoder_decoder_flops`.
    """
    return _family(cfg).training_flops(cfg, seq_len, target_len)


def _single_stack_flops(cfg: ModelConfig, seq_len: int, *, causal: bool) -> int:
    """Decoder-only / encoder-only over T = seq_len tokens, N = matmul weights (no embeddings, with the head):
        6 * N * T + 12 * T * keys * d_attn          (keys: summed over the blocks, T each without a window)
    which is PaLM's 6N + 12 L H Q T per token and, for GPT-3, Megatron-LM's 72 l h^2 (1 + s/6h + V/12lh).
    """
    attn = _attention_matmuls(cfg)
    layers = cfg.n_layers
    matmul = layers * (attn["q_o"] + attn["k_v"]) + _stack_ffn_matmuls(cfg, layers) + _head_matmuls(cfg)
    forward = 2 * matmul * seq_len + 2 * seq_len * _keys_per_query(cfg, seq_len, causal, layers) * _score_widths(cfg)
    return 3 * forward


def decoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    return _single_stack_flops(cfg, seq_len, causal=True)


def encoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    return _single_stack_flops(cfg, seq_len, causal=False)


def encoder_decoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    """Source S = seq_len and target T = target_len (default seq_len): encoder weights see S tokens; decoder
    self-attention, FFN, cross-attention Q/O and the head see T; cross-attention K/V see the
    S / cross_downsample pooled memory positions M; attention terms S*S (encoder), T*T (decoder) and T*M (cross).
    """
    d_attn = cfg.attention.n_heads * cfg.attention_head_dim
    attn = _attention_matmuls(cfg)
    source, target = seq_len, target_len if target_len is not None else seq_len
    memory = math.ceil(source / cfg.cross_downsample)
    spec = _family(cfg)
    n_enc, n_dec = spec.depth(cfg, "encoder"), spec.depth(cfg, "decoder")
    forward = 2 * source * (n_enc * (attn["q_o"] + attn["k_v"]) + _stack_ffn_matmuls(cfg, n_enc))
    forward += 2 * target * (n_dec * (2 * attn["q_o"] + attn["k_v"]) + _stack_ffn_matmuls(cfg, n_dec)
                             + _head_matmuls(cfg))
    forward += 2 * memory * n_dec * attn["k_v"]
    forward += 4 * d_attn * (
        source * _keys_per_query(cfg, source, False, n_enc)
        + target * _keys_per_query(cfg, target, True, n_dec)
        + n_dec * target * memory
    )
    return 3 * forward


def _head_matmuls(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.d_model + (cfg.d_model * cfg.d_model if cfg.head_transform else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> float:
    """Training FLOPs per token: `training_flops` / tokens, tokens = seq_len (+ target_len for encoder-decoder).

    For encoder-decoder models a "token" is any source or target token fed to the model, so MFU must be
    computed from source + target tokens per second. See `training_flops` for the formula.
    """
    tokens = seq_len
    if _family(cfg).seq2seq:
        tokens += target_len if target_len is not None else seq_len
    return training_flops(cfg, seq_len, target_len) / tokens
