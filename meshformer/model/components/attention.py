"""Softmax attention (`model/attention.py`) as three token-mixer kinds: `full_attention`, `sliding_attention` (a
window of model.attention.window keys) and `cross_attention` (a cross-attending stack's reading of the encoder
memory; the stack adds it, the config never names it). All read `[model.attention]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.attention import pieces_held
from meshformer.model.components import register
from meshformer.model.components.base import (
    FP32,
    ActivationLayout,
    GenerationCache,
    InitFn,
    TokenMixer,
    linear,
    output_projection_bytes,
)
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, GATHER_MASKED, GATHER_MEMORY, HEAD_VALUES, HEADS, ROWWISE


def attention_calls(x: ActivationLayout, cross: bool, memory_len: int, causal: bool = True) -> list[tuple[int, int]]:
    """(queries, keys) of each attention call of a branch: one call, or under context parallel one per sequence
    piece this rank holds, against the keys up to its end (causal: the same totals on every rank, which is what
    the pieces are chosen for) or all of them."""
    if cross:
        return [(x.seq, memory_len)]
    if x.cp == 1:
        return [(x.seq, x.seq)]
    return [(n, at + n if causal else x.seq * x.cp) for _, n, at in pieces_held(0, x.cp, x.seq)]


def keys_kept(x: ActivationLayout, calls: list[tuple[int, int]]) -> int:
    """Key (and value) rows attention keeps: every call's, except SDPA under context parallel, whose calls keep
    views of one gathered (and grouped-query repeated) tensor."""
    if len(calls) > 1 and not x.blockwise:
        return max(k for _, k in calls)
    return sum(k for _, k in calls)


def uses_math_attention(m: ModelConfig) -> bool:
    """Whether attention runs as explicit matmuls and softmax: the math backend, or soft-capped scores."""
    return m.attention.backend == "math" or m.attention.softcap is not None


def sdpa_mask(x: ActivationLayout, calls: list[tuple[int, int]], cross: bool) -> float:
    """The mask SDPA keeps for its backward, in the activation dtype: one (b, 1, q, k) per call (cross-attention
    always masks the source's padding)."""
    return x.batch * sum(q * k for q, k in calls) * x.bytes if cross or x.masked else 0.0


def ulysses_heads(heads: int, kv_heads: int, cp: int, tp: int) -> str | None:
    """Ulysses splits each tensor-parallel rank's query heads over cp, and its key/value heads too where cp divides
    them; fewer key/value heads than cp are repeated up to cp first (cp a multiple of them, so each rank gets the one
    its query heads read). Else why not, naming the fix."""
    local, local_kv = heads // tp, max(kv_heads // tp, 1)
    if local % cp:
        return (f"parallel.cp_method='ulysses' splits each rank's {local} attention heads (n_heads={heads} / tp={tp}) "
                f"over cp={cp}, which does not divide them; choose cp (and tp) so that cp x tp divides n_heads, or "
                "use parallel.cp_method='allgather'")
    if local_kv % cp and cp % local_kv:
        return (f"parallel.cp_method='ulysses' with {local_kv} key/value heads per rank (n_kv_heads={kv_heads} / "
                f"tp={tp}) and cp={cp}: one must divide the other; choose such a cp, or use "
                "parallel.cp_method='allgather'")
    return None


class Attention(TokenMixer):
    """Multi-head (grouped-query) softmax attention over every key, or the keys of its window."""

    name = "full_attention"
    cross: ClassVar[bool] = False

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.attention import Attention as AttentionModule

        return AttentionModule(cfg, causal=causal and not self.cross, cross=self.cross)

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        if cfg.position in ("alibi", "t5_relative"):
            return (f"model.position={cfg.position!r} biases every query's scores by its position, which Ulysses "
                    "would have to rebuild per head shard; use parallel.cp_method='allgather'")
        return ulysses_heads(cfg.attention.n_heads, cfg.kv_heads, cp, tp)

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # Colwise q/k/v shard whole heads (rows are head-major), so the module infers its local head count from the
        # shapes; GQA works whenever tp divides n_kv_heads. Per-head QK-norm weights are replicated; their gradients
        # sum over the heads of every rank. Attention sinks: one per head, split. Encoder memory arrives replicated:
        # as one DTensor its gradient is all-reduced once for k and v.
        return {"": GATHER_MEMORY if self.cross else GATHER_MASKED, "q_proj": COLWISE, "k_proj": COLWISE,
                "v_proj": COLWISE, "o_proj": ROWWISE, "q_norm": HEADS, "k_norm": HEADS, "sinks": HEAD_VALUES}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        return [("model.attention.n_heads", cfg.attention.n_heads, "attention heads are split across tensor-parallel "
                 "ranks"), ("model.attention.n_kv_heads", cfg.kv_heads, "key/value heads are split across "
                            "tensor-parallel ranks (GQA/MQA)")]

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        if name.startswith("sinks."):  # a vector: normal(init_std) under either method (transformers' gpt-oss)
            return lambda t, g: nn.init.normal_(t, std=cfg.init.std, generator=g)
        return None

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.attention import KVCache

        return KVCache()

    def cache_per_token(self, cfg: ModelConfig) -> int:
        return 2 * cfg.kv_heads * cfg.attention_head_dim  # a key and a value per key/value head

    # ---------------------------------------------------------------- parameters and FLOPs

    def params(self, cfg: ModelConfig) -> int:
        head = cfg.attention_head_dim
        d, q_dim, kv_dim = cfg.d_model, cfg.attention.n_heads * head, cfg.kv_heads * head
        # one RMSNorm weight each for queries and keys: per head (shared by the heads) or over the whole projection
        per_head = cfg.attention.qk_norm_scope == "head"
        qk_norm = 0 if not cfg.attention.qk_norm else 2 * head if per_head else q_dim + kv_dim
        qkv_bias = cfg.use_qkv_bias
        sinks = cfg.attention.n_heads if cfg.attention.sinks else 0  # one logit per head
        gate = linear(d, q_dim, qkv_bias) if cfg.attention.output_gate else 0  # the query projection's gate rows
        return (gate + linear(d, q_dim, qkv_bias) + 2 * linear(d, kv_dim, qkv_bias) + linear(q_dim, d, cfg.bias)
                + qk_norm + sinks)

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """Q and O projections (and the output gate's rows of Q) over the queries, K and V over the keys, and QK^T
        and AV: 2 * 2 * queries * keys per query * d_attn, where a window limits the keys per query (causal
        attention is not halved: PaLM's convention, dense kernels)."""
        head = cfg.attention_head_dim
        d, d_attn, kv_dim = cfg.d_model, cfg.attention.n_heads * head, cfg.kv_heads * head
        window = self.window(cfg)
        per_query = keys if window is None else min(keys, window if causal else 2 * window - 1)
        query_side = 3 if cfg.attention.output_gate else 2
        return 2 * queries * query_side * d * d_attn + 2 * keys * 2 * d * kv_dim + 4 * d_attn * queries * per_query

    # ---------------------------------------------------------------- activations (planner/activations.py)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """The (gathered) normalised input the projections read; SDPA's q, k, v (GQA: repeated to every head),
        output and fp32 log-sum-exp, and its mask where there is one; the math backend's fp32 softmax instead of the
        log-sum-exp; the blockwise kernel's probabilities."""
        m, b, s, a = cfg, x.batch, x.seq, x.bytes
        heads = m.attention.n_heads // x.tp
        qkv_out = b * s * heads * m.attention_head_dim * a
        calls = attention_calls(x, self.cross, memory_len, causal)
        kv = b * keys_kept(x, calls) * heads * m.attention_head_dim * a
        total: float = b * s * m.d_model * a
        if m.attention.output_gate:  # sigmoid(gate) and the gated output o_proj reads
            total += 2 * qkv_out
        if m.attention.qk_norm:
            total += self._qk_norm_bytes(m, x, heads, m.kv_heads // x.tp)
        if uses_math_attention(m):
            scores = b * heads * sum(q * k for q, k in calls)
            total += 2 * qkv_out + 2 * kv + scores * FP32 + (scores * a if a != FP32 else 0)
            if m.attention.softcap is not None:  # the capped scores' tanh, kept for its backward
                total += scores * a
            if m.attention.dropout > 0:
                total += scores * (a + 1)
        elif x.blockwise:
            from meshformer.model.blockwise_attention import stored_probabilities

            total += 2 * qkv_out + 2 * kv + sum(stored_probabilities(b * heads, q, k, causal and not self.cross)
                                                for q, k in calls) * a
        else:
            total += 2 * qkv_out + 2 * kv + b * heads * s * FP32 + sdpa_mask(x, calls, self.cross)
        return total

    @staticmethod
    def _qk_norm_bytes(m: ModelConfig, x: ActivationLayout, heads: int, kv_heads: int) -> float:
        """QK-norm's RMSNorms upcast: their fp32 inputs and normalised copies, one statistic per row (a head's, or
        the whole projection's), and the normalised queries and keys the rotary embedding reads."""
        rows = x.batch * x.seq
        width = (heads + kv_heads) * m.attention_head_dim
        statistics = rows * (heads + kv_heads if m.attention.qk_norm_scope == "head" else 2)
        return rows * width * (2 * FP32 + x.bytes) + statistics * FP32

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        m, b, s, t, a = cfg, x.batch, x.seq, x.tp, x.bytes
        heads, kv_heads = m.attention.n_heads // t, m.kv_heads // t
        calls = attention_calls(x, self.cross, memory_len, causal)
        # q projection (with the output gate's rows) and attention output
        total: float = b * s * heads * m.attention_head_dim * a * (3 if m.attention.output_gate else 2)
        total += 2 * b * (memory_len if self.cross else s) * kv_heads * m.attention_head_dim * a  # k, v projections
        if x.blockwise:  # the kernel's own q/k/v rows (GQA: repeated) and probabilities
            from meshformer.model.blockwise_attention import stored_probabilities

            total += (s + 2 * sum(k for _, k in calls)) * b * heads * m.attention_head_dim * a
            total += sum(stored_probabilities(b * heads, q, k, causal and not self.cross) for q, k in calls) * a
        else:
            total += b * heads * s * FP32 + sdpa_mask(x, calls, self.cross)  # log-sum-exp, mask
        if uses_math_attention(m):  # the two attention matmuls' outputs (scores, weighted values)
            total += 2 * b * heads * sum(q * k for q, k in calls) * a
        return total + output_projection_bytes(m, x)

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        m, b, s, a = cfg, x.batch, x.seq, x.bytes
        heads = m.attention.n_heads // x.tp
        calls = attention_calls(x, False, 0)
        keys = max(k for _, k in calls)  # under context parallel: the gathered sequence's key/value gradients
        total: float = 2 * b * (s + keys) * heads * m.attention_head_dim * a  # gradients of q and output, k and v
        if m.attention.backend == "math":
            total += 2 * b * heads * sum(q * k for q, k in calls) * FP32
        elif x.blockwise:
            from meshformer.model.blockwise_attention import backward_workspace

            # its workspace is large, but by then the channel mixer has back-propagated and freed what it kept
            # (under context parallel counted at this rank's length: within 6% of measured, docs/benchmarks/parallel.md)
            total = backward_workspace(b * heads, s, m.attention_head_dim, a) - freed
        return total


class SlidingAttention(Attention):
    """Attention to the keys within model.attention.window positions (|i - j| < window)."""

    name = "sliding_attention"

    def window(self, cfg: ModelConfig) -> int | None:
        return cfg.attention.window

    def check(self, cfg: ModelConfig) -> None:
        if cfg.attention.window is None:
            raise ConfigError("model.layer_types has sliding_attention blocks but model.attention.window is not set",
                              "set model.attention.window (e.g. 4096), or make every block full_attention")


class CrossAttention(Attention):
    """The decoder's attention to the encoder memory (no causal mask, no position scheme, its own cache)."""

    name = "cross_attention"
    cross = True
    selectable = False

    def context_parallel(self, cfg: ModelConfig) -> str | None:
        return (f"context parallel is implemented for decoder-only and encoder-only models, not {cfg.family!r} (its "
                "cross-attention would need the whole encoder output on every rank)")


register(Attention())
register(SlidingAttention())
register(CrossAttention())
