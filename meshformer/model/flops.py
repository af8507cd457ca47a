"""Parameter counts and training FLOPs straight from a `ModelConfig`, without building the model.

`count_params(cfg)["total"]` equals `sum(p.numel() for p in Transformer(cfg).parameters())` (tied
tensors once), and `flops_per_token` is the PaLM / Megatron-LM formula used for MFU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshformer.model.components import channel_mixer, cross_mixer, token_mixer
from meshformer.model.components.base import linear
from meshformer.model.config import ModelConfig
from meshformer.model.residual import residual_kind

if TYPE_CHECKING:
    from meshformer.model.families.spec import FamilySpec


def _family(cfg: ModelConfig) -> FamilySpec:
    from meshformer.model.families import get_family_spec  # the specs point back at this module's formulas

    return get_family_spec(cfg.family)


def _norm(cfg: ModelConfig) -> int:
    return cfg.d_model * (2 if cfg.norm.kind == "layernorm" and cfg.bias else 1)  # RMSNorm has no bias


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of `Transformer(cfg)`.

    embedding: lookup tables (token, separate source, learned positions, T5 relative biases) plus a tied output
        projection, which is the same tensor. They cost no matmul FLOPs as lookups (Kaplan et al.'s N
        excludes them).
    non_embedding: everything else = total - embedding, including an untied output projection.
    attention / feed_forward / norms / head / mtp / residual: a breakdown of non_embedding (head = BERT head
        transform, untied output projection, output bias; attention includes its QK-norm weights; mtp = the
        multi-token prediction modules, model.mtp; residual = the residual kind's mixing weights, model.residual,
        listed where it holds any); embedding + attention + feed_forward + norms + head + mtp + residual = total.
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
    attention = sum(token_mixer(cfg, i).params(cfg) + (cross_mixer().params(cfg) if cross else 0)
                    for n, cross in stacks for i in range(n))
    ffn = [channel_mixer(cfg, i).params(cfg) for n, _ in stacks for i in range(n)]
    feed_forward = sum(all_ for all_, _ in ffn)
    inactive = feed_forward - sum(active for _, active in ffn)
    stack_norms = len(stacks) if cfg.use_final_norm else 0
    sublayers = sum(int(cross) + int(not token_mixer(cfg, i).empty) + int(not channel_mixer(cfg, i).empty)
                    for n, cross in stacks for i in range(n))
    norms_per_block = sublayers * (2 if cfg.norm.position == "sandwich" else 1)
    norms = (norms_per_block + stack_norms + int(cfg.norm.embedding)) * _norm(cfg)
    mtp, mtp_inactive = _mtp_params(cfg)
    residual = residual_kind(cfg).params(cfg, branches=sublayers, stacks=len(stacks))
    head = 0
    if cfg.head_transform:
        head += linear(d, d, cfg.bias) + _norm(cfg)
    if not cfg.tie_embeddings:
        head += vocab * d
    if cfg.output_bias:
        head += vocab
    total = embedding + attention + feed_forward + norms + head + mtp + residual
    inactive += mtp_inactive
    counts = {
        "total": total,
        "embedding": embedding,
        "non_embedding": total - embedding,
        "attention": attention,
        "feed_forward": feed_forward,
        "norms": norms,
        "head": head,
        "mtp": mtp,
        "active": total - inactive,
    }
    return {**counts, "residual": residual} if residual else counts


def _mtp_params(cfg: ModelConfig) -> tuple[int, int]:
    """(all, inactive) parameters of the multi-token prediction modules (model/mtp.py): per module three norms, the
    2d -> d projection (mHC: its two d -> d halves), one block of its kinds with the residual's joins, and the
    residual's merge (mHC's); the embedding and head are the model's."""
    if cfg.mtp.depth == 0:
        return 0, 0
    from meshformer.model.mtp import block_kinds  # mtp builds blocks, which read this module

    kinds, index = block_kinds(cfg)
    ffn_all, ffn_active = channel_mixer(kinds, index).params(kinds)
    norms = int(not token_mixer(kinds, index).empty) + int(not channel_mixer(kinds, index).empty)
    block = token_mixer(kinds, index).params(kinds) + ffn_all + norms * _norm(cfg)
    joins = residual_kind(cfg).params(cfg, branches=norms, stacks=1)
    per_module = 3 * _norm(cfg) + 2 * cfg.d_model * cfg.d_model + block + joins
    return cfg.mtp.depth * per_module, cfg.mtp.depth * (ffn_all - ffn_active)


def mtp_forward_flops(cfg: ModelConfig, tokens: int) -> int:
    """Forward FLOPs of the multi-token prediction modules over one sequence: each module's projection, block
    (its kinds) and output head over every position."""
    if cfg.mtp.depth == 0:
        return 0
    from meshformer.model.mtp import block_kinds

    kinds, index = block_kinds(cfg)
    block = (token_mixer(kinds, index).flops(kinds, tokens, tokens, causal=True)
             + channel_mixer(kinds, index).flops(kinds, tokens))
    return cfg.mtp.depth * (block + 2 * tokens * (2 * cfg.d_model * cfg.d_model + _head_matmuls(cfg)))


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


def stack_forward_flops(cfg: ModelConfig, n_blocks: int, tokens: int, *, causal: bool, memory: int = 0) -> int:
    """Forward FLOPs of a stack's first n_blocks blocks over one sequence of `tokens` positions, each block's
    token mixer, cross-attention of `memory` positions (memory > 0) and channel mixer as its kinds declare them."""
    total = 0
    join = residual_kind(cfg).flops(cfg, tokens)  # each branch's join to the stream
    for block in range(n_blocks):
        total += token_mixer(cfg, block).flops(cfg, tokens, tokens, causal=causal) + join
        if memory:
            total += cross_mixer().flops(cfg, tokens, memory, causal=False) + join
        total += channel_mixer(cfg, block).flops(cfg, tokens) + join
    return total


def _single_stack_flops(cfg: ModelConfig, seq_len: int, *, causal: bool) -> int:
    """Decoder-only / encoder-only over T = seq_len tokens: the blocks' declared FLOPs and the head's 2 T N, which
    for full attention is PaLM's 6N + 12 L H Q T per token and, for GPT-3, Megatron-LM's 72 l h^2 (1 + s/6h +
    V/12lh)."""
    forward = stack_forward_flops(cfg, cfg.n_layers, seq_len, causal=causal) + 2 * seq_len * _head_matmuls(cfg)
    if causal:  # multi-token prediction trains beside a causal stack
        forward += mtp_forward_flops(cfg, seq_len)
    return 3 * forward


def decoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    return _single_stack_flops(cfg, seq_len, causal=True)


def encoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    return _single_stack_flops(cfg, seq_len, causal=False)


def encoder_decoder_flops(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> int:
    """Source S = seq_len and target T = target_len (default seq_len): the encoder's blocks see S tokens; the
    decoder's blocks and the head see T, their cross-attention the S / cross_downsample pooled memory positions.
    """
    source, target = seq_len, target_len if target_len is not None else seq_len
    memory = math.ceil(source / cfg.cross_downsample)
    spec = _family(cfg)
    forward = stack_forward_flops(cfg, spec.depth(cfg, "encoder"), source, causal=False)
    forward += stack_forward_flops(cfg, spec.depth(cfg, "decoder"), target, causal=True, memory=memory)
    forward += 2 * target * _head_matmuls(cfg)
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
