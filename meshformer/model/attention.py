"""Multi-head attention with grouped-query heads, RoPE/ALiBi, a KV cache, and SDPA, blockwise or math backends."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from meshformer.model.blockwise_attention import blockwise_attention, blockwise_attention_max, picks_blockwise
from meshformer.model.config import ModelConfig
from meshformer.model.masks import AttentionMask
from meshformer.model.norms import make_rms_norm
from meshformer.model.positions import apply_rope

# model.attention_backend -> the SDPA kernel tried first. torch's other kernels follow in its default order (flash,
# efficient, math, cuDNN), so a call the preferred kernel cannot serve (a mask it does not take, a CPU run for
# cuDNN) still runs on the next one. `set_priority` needs torch >= 2.6 (respected under torch.compile from 2.7).
_PREFERRED_SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}

# How MuonClip's QK-clip scales a row of a head whose logits it multiplies by gamma (a kind's `qk_clip_rows`): not at
# all, by sqrt(gamma), by gamma
KEEP, ROOT, WHOLE = 0, 1, 2


@runtime_checkable
class ClipsLogits(Protocol):
    """An attention module MuonClip records and clips (train/qk_clip.py): `Attention`, `MultiHeadLatentAttention`."""

    max_logit: torch.Tensor  # per query head, the largest logit of the step's training forwards so far
    record_max_logit: bool

    def qk_clip_rows(self) -> list[tuple[nn.Linear, int, list[int]]]:
        """(projection, rows per head, how each row of a head scales: KEEP, ROOT or WHOLE), the queries' first."""
        ...


def sdpa_order(backend: str) -> list[SDPBackend] | None:
    """SDPA kernels in priority order for `backend`, or None to leave torch's own choice ("sdpa", "math")."""
    first = _PREFERRED_SDPA.get(backend)
    if first is None:
        return None
    rest = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, SDPBackend.CUDNN_ATTENTION]
    return [first, *(b for b in rest if b != first)]


@dataclass(frozen=True)
class SequenceChunk:
    """Context parallel, set up from outside (meshformer/parallel/context.py): each sequence is cut into 2 x count
    equal pieces and this rank (`index` of `count`) holds pieces index and 2 x count - 1 - index, an early and a
    late one, so that every rank does the same causal attention work. `gather` all-gathers a (B, H, T/count, D)
    tensor along dim 2 in rank order, differentiably."""

    index: int
    count: int
    gather: Callable[[torch.Tensor], torch.Tensor]
    # Ulysses (parallel.cp_method="ulysses"): a differentiable all-to-all of a (count, ...) tensor over the cp ranks,
    # slice r to rank r; None: the all-gather method
    exchange: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def ulysses(self) -> bool:
        return self.exchange is not None

    def to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """Ulysses: this rank's pieces of every head (B, H, T/count, D) -> this rank's H/count heads over the whole
        sequence in order (B, H/count, T, D); rank r keeps heads r x H/count onward."""
        assert self.exchange is not None
        batch, heads, length, dim = t.shape
        n = self.count
        # slice r: rank r's heads of this rank's tokens; after the exchange slice r is rank r's tokens of my heads
        mine = self.exchange(t.reshape(batch, n, heads // n, length, dim).transpose(0, 1).contiguous())
        pieces = mine.unflatten(3, (2, length // 2))  # (count, B, H/count, 2, T/2count, D): each rank's two pieces
        order = [pieces[p, :, :, 0] if p < n else pieces[2 * n - 1 - p, :, :, 1] for p in range(2 * n)]
        return torch.cat(order, dim=2)

    def to_sequence(self, t: torch.Tensor) -> torch.Tensor:
        """`to_heads` undone: (B, H/count, T, D) over the whole sequence -> this rank's pieces of every head."""
        assert self.exchange is not None
        batch, heads, length, dim = t.shape
        n = self.count
        parts = t.chunk(2 * n, dim=2)
        held = torch.stack([torch.cat([parts[r], parts[2 * n - 1 - r]], dim=2) for r in range(n)])
        mine = self.exchange(held.contiguous())  # slice r: my tokens of rank r's heads
        return mine.transpose(0, 1).reshape(batch, heads * n, length // n, dim)

    def spans(self, local_len: int) -> list[tuple[int, int, int]]:
        """(start in this rank's tokens, length, start in the sequence) of each piece it holds."""
        return pieces_held(self.index, self.count, local_len)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The sequence positions of this rank's tokens."""
        return torch.cat([torch.arange(at, at + n, device=device) for _, n, at in self.spans(local_len)])

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, H, T/count, D) pieces gathered and put in sequence order: (B, H, T, D)."""
        pieces = self.gather(t.contiguous()).chunk(2 * self.count, dim=2)  # rank r's early piece, then its late one
        n = self.count
        return torch.cat([pieces[2 * p if p < n else 2 * (2 * n - 1 - p) + 1] for p in range(2 * n)], dim=2)


def ulysses_kv(chunk: SequenceChunk, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values to this rank's heads (`SequenceChunk.to_heads`); fewer key/value heads than ranks are first
    repeated up to `count` (config validation: count a multiple of them), so rank r gets the head its queries read."""
    if k.shape[1] % chunk.count:
        k, v = (t.repeat_interleave(chunk.count // t.shape[1], dim=1) for t in (k, v))
    return chunk.to_heads(k), chunk.to_heads(v)


def pieces_held(index: int, count: int, local_len: int) -> list[tuple[int, int, int]]:
    """`SequenceChunk.spans` as a function (the planner counts the keys each piece's queries see)."""
    half = local_len // 2
    return [(0, half, index * half), (half, half, (2 * count - 1 - index) * half)]


class AttentionSinks(nn.Module):
    """A learned logit per query head in each softmax's denominator (gpt-oss): weights exp(s_j) / (sum_k exp(s_k) +
    exp(sink)), so a query may give every key little weight. A module of its own so that tensor parallelism splits
    it with the heads (style HEAD_VALUES); `forward` gives this rank's heads."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


def with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax weights of `scores` (B, H, Tq, Tk) with each head's sink in the denominator (None: plain softmax)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def sink_as_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None,
                sinks: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask, torch.Tensor | None]:
    """Attention sinks for SDPA kernels, which take none: each head's sink as a key at position 0 that every query
    sees, whose score is the sink and whose value is zero. The heads widen to the next multiple of 8 above D (flash
    kernels' granularity): queries carry a 1 in column D, the sink key sink / scale there and the other keys 0, so
    every score is unchanged and the sink's is `sink`. The caller keeps the output's first D columns. Exact, with
    gradients for the sink by autograd, on every SDPA kernel; the cost is the widened heads and one key more."""
    batch, heads, q_len, head_dim = q.shape
    extra = 8 - head_dim % 8
    one = q.new_ones(batch, heads, q_len, 1)
    q = torch.cat([q, one, q.new_zeros(batch, heads, q_len, extra - 1)], dim=-1)
    sink_key = torch.cat([k.new_zeros(heads, head_dim), (sinks.to(k.dtype) / scale).view(heads, 1),
                          k.new_zeros(heads, extra - 1)], dim=-1).view(1, heads, 1, head_dim + extra)
    sink_key = sink_key.expand(batch, heads, 1, head_dim + extra)
    k = torch.cat([sink_key, F.pad(k, (0, extra))], dim=2)
    v = F.pad(torch.cat([v.new_zeros(batch, heads, 1, head_dim), v], dim=2), (0, extra))
    # the sink key is always allowed; causal without a mask tensor stays aligned at the bottom right
    if mask.mask is not None:
        mask = AttentionMask(torch.cat([mask.mask.new_ones(*mask.mask.shape[:-1], 1), mask.mask], dim=-1),
                             mask.is_causal)
    if bias is not None:
        bias = torch.cat([bias.new_zeros(*bias.shape[:-1], 1), bias], dim=-1)
    return q, k, v, mask, bias


@dataclass
class KVCache:
    """Keys and values an attention layer has already computed, shaped (B, H_kv, T, D)."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class Attention(nn.Module):
    """Self- or cross-attention with independent Q/K/V/O projections.

    Head counts are inferred from tensor shapes (`view(..., -1, head_dim)`) so that a tensor-parallel
    plan that shards the projections by heads needs no change here.
    """

    max_logit: torch.Tensor  # a buffer (see `record_max_logit`)

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.head_dim = cfg.attention_head_dim
        self.scale = cfg.attention.scale if cfg.attention.scale is not None else 1.0 / math.sqrt(cfg.attention_head_dim)
        self.causal, self.cross = causal, cross
        # output gate: each head's query rows are followed by as many gate rows (one GEMM; a head shard keeps both)
        self.output_gate = cfg.attention.output_gate
        q_width = cfg.attention.n_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(cfg.d_model, q_width, bias=cfg.use_qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=cfg.use_qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=cfg.use_qkv_bias)
        self.o_proj = nn.Linear(cfg.attention.n_heads * self.head_dim, cfg.d_model, bias=cfg.bias)
        # QK-norm per head (Qwen3): one weight of size head_dim shared by every head, so a head shard holds all of
        # it; over the whole projection (OLMo 2): one weight as wide as q (k), the mean square over all its heads
        self.qk_norm_scope = cfg.attention.qk_norm_scope
        per_head = cfg.attention.qk_norm_scope == "head"
        self.q_norm = make_rms_norm(cfg, self.head_dim if per_head else cfg.attention.n_heads * self.head_dim) \
            if cfg.attention.qk_norm else None
        self.k_norm = make_rms_norm(cfg, self.head_dim if per_head else cfg.kv_heads * self.head_dim) \
            if cfg.attention.qk_norm else None
        self.sinks = AttentionSinks(cfg.attention.n_heads) if cfg.attention.sinks else None
        self.softcap = cfg.attention.softcap
        self.dropout_p = cfg.attention.dropout
        self.backend = cfg.attention.backend
        self.use_math = cfg.attention.backend == "math"
        self.sdpa_order = sdpa_order(cfg.attention.backend)
        self.capture_weights = False  # inspection hook: keep the last attention weights in `.weights`
        self.weights: torch.Tensor | None = None
        # MuonClip (train/qk_clip.py) sets `record_max_logit`: each training forward then keeps, per query head of
        # this rank, the largest logit q·k·scale (before bias, soft-cap and sinks; over the keys each query sees)
        # in `max_logit[:heads]`, a running max until the clip resets it. Only the blockwise and math paths
        # see the scores; with recording on, calls the blockwise kernel cannot take run the math path.
        self.record_max_logit = False
        self.register_buffer("max_logit", torch.full((cfg.attention.n_heads,), float("-inf")), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After a meta build: no logit recorded yet."""
        self.max_logit.fill_(float("-inf"))

    def qk_clip_rows(self) -> list[tuple[nn.Linear, int, list[int]]]:
        """MuonClip's rule (`train/qk_clip.py`): (projection, rows per head, how each row of a head scales).
        A head with its own key head: its query and key rows by sqrt(gamma); grouped-query attention, where a key
        head serves several query heads: the query rows by gamma, the shared key left as it is (Kimi K2's rule for
        MLA's shared rotary key, applied to the whole key), so that no other head's logits change."""
        d = self.head_dim
        if self.k_proj.weight.shape[0] != self.q_proj.weight.shape[0]:  # global shapes, DTensor or not
            return [(self.q_proj, d, [WHOLE] * d), (self.k_proj, d, [KEEP] * d)]
        return [(self.q_proj, d, [ROOT] * d), (self.k_proj, d, [ROOT] * d)]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, -1, self.head_dim).transpose(1, 2)

    def _normed_heads(self, norm: nn.Module | None, projected: torch.Tensor) -> torch.Tensor:
        """(B, T, H x D) projected queries or keys as (B, H, T, D) heads, QK-normed over each head's D or over the
        whole H x D (qk_norm_scope); only split without QK-norm."""
        if norm is None:
            return self._heads(projected)
        if self.qk_norm_scope == "projection":
            return self._heads(norm(projected))
        return norm(self._heads(projected))

    def _packable(self) -> bool:
        """Whether Q, K and V can run as one GEMM: plain, unhooked nn.Linear projections with plain-tensor weights
        and biases on all or none.

        Not under tensor parallel (DTensor weights, each projection's own sharding hooks) nor once the layers
        were swapped for float8 (or any other) Linear subclasses, whose own forward must run.
        """
        projections = (self.q_proj, self.k_proj, self.v_proj)
        return (all(type(p) is nn.Linear and not isinstance(p.weight, DTensor) and not p._forward_hooks
                    and not p._forward_pre_hooks for p in projections)
                and len({p.bias is None for p in projections}) == 1)

    def _packed_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x @ [Wq; Wk; Wv]^T (+ biases) in one GEMM; the parameters stay three. On CPU at GPT-2 widths three
        GEMMs of width d cost more than one of width 3d, forward and backward. Same products, same dtype."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if self.q_proj.bias is not None else None  # type: ignore
        q, k, v = F.linear(x, weight, bias).split([p.out_features for p in projections], dim=-1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        *,
        memory: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
        cache: KVCache | None = None,
        chunk: SequenceChunk | None = None,
    ) -> torch.Tensor:
        """chunk: under context parallel (self-attention only), the pieces of the sequence `x` holds."""
        gate = None
        if self.cross and cache is not None and cache.k is not None and cache.v is not None:
            q, gate = self._gated(self.q_proj(x))
            q = self._normed_heads(self.q_norm, q)
            k, v = cache.k, cache.v  # the encoder output does not change while decoding
        else:
            if not self.cross and self._packable():
                q, k, v = self._packed_qkv(x)
            else:
                source = memory if self.cross else x
                q, k, v = self.q_proj(x), self.k_proj(source), self.v_proj(source)
            q, gate = self._gated(q)
            q, k, v = self._normed_heads(self.q_norm, q), self._normed_heads(self.k_norm, k), self._heads(v)
            if rope is not None:  # self-attention only: new queries and keys share positions
                q, k = apply_rope(q, rope), apply_rope(k, rope)
            if chunk is not None and chunk.ulysses:  # this rank's heads over the whole sequence
                q, k, v = chunk.to_heads(q), *ulysses_kv(chunk, k, v)
            elif chunk is not None:  # the whole sequence's keys and values (after RoPE: each keeps its position)
                k, v = chunk.whole(k), chunk.whole(v)
                if k.shape[1] != q.shape[1]:  # grouped-query heads repeated once, not once per piece
                    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            if cache is not None:
                if not self.cross and cache.k is not None and cache.v is not None:
                    k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
                cache.k, cache.v = k, v
        if chunk is not None and chunk.ulysses:  # whole sequences, the mask over them; then back to this rank's pieces
            heads = slice(chunk.index * q.shape[1], (chunk.index + 1) * q.shape[1])  # of this rank's before
            out = chunk.to_sequence(self._attend(q, k, v, mask, bias, heads))
        elif chunk is not None:
            # each piece's queries against the keys it may see (causal: up to its end, aligned at the bottom right;
            # bidirectional: all), with its rows of a padding or window mask over the whole sequence
            pieces = []
            for start, n, at in chunk.spans(q.shape[2]):
                keys = at + n if self.causal else k.shape[2]
                piece_mask = mask if mask.mask is None else AttentionMask(mask.mask[..., start:start + n, :keys])
                piece_bias = None if bias is None else bias[..., start:start + n, :keys]
                pieces.append(self._attend(q[:, :, start:start + n], k[:, :, :keys], v[:, :, :keys], piece_mask,
                                           piece_bias))
            out = torch.cat(pieces, dim=2)
        else:
            out = self._attend(q, k, v, mask, bias)
        batch, _, length, _ = out.shape
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def _gated(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(queries (B, T, H x D), output gate (B, T, H x D) or None) from the query projection."""
        if not self.output_gate:
            return projected, None
        batch, length, _ = projected.shape
        q, gate = projected.view(batch, length, -1, 2 * self.head_dim).chunk(2, dim=-1)
        return q.reshape(batch, length, -1), gate.reshape(batch, length, -1)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None,
        heads: slice | None = None,
    ) -> torch.Tensor:
        """heads: under Ulysses, which of this module's heads q holds (their sinks)."""
        if k.shape[1] != q.shape[1]:  # grouped-query: each K/V head serves a group of query heads
            repeat = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(repeat, dim=1) for t in (k, v))
        dropout_p = self.dropout_p if self.training else 0.0
        sinks = None if self.sinks is None else self.sinks()
        if sinks is not None and heads is not None:
            sinks = sinks[heads]
        if self.use_math or self.capture_weights or self.softcap is not None:  # no fused kernel soft-caps scores
            return self._math(q, k, v, mask, bias, dropout_p, sinks)
        plain = (mask.mask is None and bias is None and dropout_p == 0.0 and not isinstance(q, DTensor)
                 and not torch.compiler.is_compiling())
        record = self.record_max_logit and self.training
        if picks_blockwise(self.backend, q.device.type, max(q.shape[2], k.shape[2]), self.head_dim, plain, record):
            if not record:
                return blockwise_attention(q, k, v, scale=self.scale, causal=mask.is_causal, sinks=sinks)
            out, max_logit = blockwise_attention_max(q, k, v, scale=self.scale, causal=mask.is_causal, sinks=sinks)
            self._record(max_logit)
            return out
        if record:  # config validation allows recording with auto, blockwise and math only
            return self._math(q, k, v, mask, bias, dropout_p, sinks)
        if sinks is not None:  # no SDPA kernel takes a sink: each head's sink becomes one more key
            q, k, v, mask, bias = sink_as_key(q, k, v, mask, bias, sinks, self.scale)
        if self.sdpa_order is None:
            out = self._sdpa(q, k, v, mask, bias, dropout_p)
        else:
            with sdpa_kernel(self.sdpa_order, set_priority=True):
                out = self._sdpa(q, k, v, mask, bias, dropout_p)
        return out if sinks is None else out[..., :self.head_dim]

    def _record(self, per_head: torch.Tensor) -> None:
        """Fold one call's largest logit per query head (H,) into `max_logit` (a running max over the step)."""
        if isinstance(per_head, DTensor):  # heads sharded over tensor-parallel ranks: this rank's heads
            per_head = per_head.to_local()
        seen = self.max_logit[:per_head.shape[0]]
        torch.maximum(seen, per_head.detach().to(seen.dtype), out=seen)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, bias: torch.Tensor | None,
              dropout_p: float) -> torch.Tensor:
        if bias is None:
            if mask.is_causal and q.shape[2] != k.shape[2]:  # SDPA's is_causal aligns at the top left
                # torch's lower-right causal bias lets flash kernels run, but dynamo cannot build it (a graph break
                # per call): compiled code passes the boolean mask instead
                lower_right = (mask.materialize(q.shape[2], k.shape[2], q.device) if torch.compiler.is_compiling()
                               else causal_lower_right(q.shape[2], k.shape[2]))
                return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right, dropout_p=dropout_p,
                                                      scale=self.scale)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask.mask, dropout_p=dropout_p, is_causal=mask.is_causal, scale=self.scale
            )
        allowed = mask.materialize(q.shape[2], k.shape[2], q.device)
        additive = bias.to(q.dtype)[None]
        if allowed is not None:
            additive = additive.masked_fill(~allowed, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=additive, dropout_p=dropout_p, scale=self.scale)

    def _math(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: AttentionMask,
        bias: torch.Tensor | None,
        dropout_p: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * self.scale
        allowed = mask.materialize(q.shape[2], k.shape[2], q.device)
        record = self.record_max_logit and self.training
        # the largest q·k·scale logit of allowed keys: after the mask fill where nothing else changes the scores
        # (no copy), else from a masked copy of the raw scores
        raw_needed = record and (self.softcap is not None or bias is not None)
        if raw_needed:
            raw = scores.detach()
            self._record((raw if allowed is None else raw.masked_fill(~allowed, float("-inf"))).amax(dim=(0, 2, 3)))
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        if allowed is not None:
            # A finite fill keeps every row finite even before `build_mask` opens empty rows.
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if record and not raw_needed:
            self._record(scores.detach().amax(dim=(0, 2, 3)))
        # Softmax in at least fp32: upcasts bf16/fp16 but must not downcast fp64 (whose fill value would become -inf).
        weights = with_sinks(scores.to(torch.promote_types(scores.dtype, torch.float32)), sinks).to(q.dtype)
        if self.capture_weights:
            self.weights = weights.detach()
        weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0)
        return weights @ v


@contextmanager
def logits_not_recorded(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Forwards inside this block leave the attention layers' `max_logit` (MuonClip) as it is: e.g. a pipeline
    stage's shape-inference forward on placeholder inputs."""
    recording = [m for m in modules if isinstance(m, ClipsLogits) and m.record_max_logit]
    for layer in recording:
        layer.record_max_logit = False
    try:
        yield
    finally:
        for layer in recording:
            layer.record_max_logit = True
