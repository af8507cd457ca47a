"""Pieces of DeepSeek-V4's attention and routing, each checked on its own against transformers' module.

- `GroupedOutputProjection`: the heads' outputs split into groups, each projected on its own to a narrow width,
  then one projection of the concatenation to d_model (V4's o_a / o_b: far fewer weights than heads x head_dim
  to d_model).
- `Compressor`: the compressed keys (and values: V4 reads one tensor as both) of heavily compressed attention (HCA:
  every `rate` tokens become one entry, a softmax-gated sum with a learned per-slot bias, normed, its trailing rotary
  slice rotated at the window's first position) and of compressed sparse attention (CSA: overlapping windows of
  2 x rate). A query sees an entry only once its whole window lies at or before it.
- `Indexer`: CSA's lightning indexer, which keeps each query's top-k compressed entries.
- `CompressedAttention`: V4's attention (whole-sequence path): one shared key/value head (MQA, keys are values),
  queries through a normed low-rank latent and an unweighted per-head RMSNorm, rotary on each head's trailing slice,
  a sliding window over the tokens plus, in HCA blocks, every compressed entry a query may see; a learned sink logit
  per head; the output's rotary slice turned back by its query's angle, then the grouped output projection.
  `V4Attention` is the block-facing module of the token-mixer kinds "sliding_mqa", "hca" and "csa"
  (model/components/v4_attention.py).
- `HashRouter`: the first blocks' MoE routing: each token's experts are a fixed table's row for its token id; the
  learned gate only weighs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.errors import ConfigError

if TYPE_CHECKING:
    from meshformer.model.attention import SequenceChunk


class GroupedOutputProjection(nn.Module):
    """(B, T, heads x head_dim) -> (B, T, d_model) through `groups` separate (heads x head_dim / groups) -> rank
    projections, then one (groups x rank) -> d_model projection."""

    def __init__(self, width: int, groups: int, rank: int, d_model: int) -> None:
        super().__init__()
        if width % groups:
            raise ValueError(f"the heads' width {width} does not split into {groups} groups")
        self.groups = groups
        # one (rank, width / groups) matrix per group, stacked: group g's rows are g * rank .. (g + 1) * rank
        self.o_a_proj = nn.Parameter(torch.empty(groups * rank, width // groups))
        self.o_b_proj = nn.Linear(groups * rank, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.unflatten(-1, (self.groups, -1))  # (..., G, width / G)
        weight = self.o_a_proj.unflatten(0, (self.groups, -1))  # (G, rank, width / G)
        return self.o_b_proj(torch.einsum("...gi,gri->...gr", grouped, weight).flatten(-2))


def rotary_tables(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., dim / 2) of one angle per rotated pair (pairs of neighbouring channels)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    angles = positions[..., None].float() * inv_freq
    return angles.cos(), angles.sin()


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 x cos.shape[-1] channels of x by neighbouring pairs (2i, 2i + 1); the rest pass."""
    width = 2 * cos.shape[-1]
    rest, tail = x[..., :-width], x[..., -width:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([rest, rotated.to(x.dtype)], dim=-1)


INDEX_SCORES = 2**25  # float32 indexer scores (128 MiB) computed at once: one block of queries against every entry
Span = tuple[int, int, int]  # (start among this rank's tokens, length, start in the sequence): a contiguous piece


def _whole(t: torch.Tensor, chunk: SequenceChunk | None) -> torch.Tensor:
    """(B, n, D) of this rank's pieces -> (B, N, D) of every rank's, in sequence order (identity on one rank)."""
    return t if chunk is None else chunk.whole(t[:, None]).squeeze(1)


def _spans(length: int, chunk: SequenceChunk | None) -> list[Span]:
    return [(0, length, 0)] if chunk is None else chunk.spans(length)


class Compressor(nn.Module):
    """The compressed keys of a (B, T, D) input: (B, T // rate, head_dim) and the (T, T // rate) mask of the
    entries each query may see (True: visible).

    HCA (`overlap` false): entry w is the gated sum over window w's `rate` tokens. CSA (`overlap` true): every token
    projects two halves, one for its own window's entry and one for the next window's, so entry w sums over 2 x rate
    slots (window w - 1's first halves, window w's second halves; entry 0 has only its own).

    Under context parallel (`entries` with a `SequenceChunk`) each rank compresses the windows of its own pieces
    (a piece's length must be a multiple of `rate`, so no window straddles two pieces); CSA's first window of a
    piece reads the previous piece's last window, whose first halves every rank all-gathers (rate tokens a piece),
    and the entries are all-gathered in sequence order (T / rate of them)."""

    def __init__(self, d_model: int, head_dim: int, rate: int, rope_dim: int, rope_theta: float, eps: float,
                 overlap: bool = False) -> None:
        super().__init__()
        self.rate, self.rope_dim, self.rope_theta, self.overlap = rate, rope_dim, rope_theta, overlap
        self.head_dim = head_dim
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(d_model, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))  # one gate bias per slot of a window
        self.kv_norm = nn.RMSNorm(head_dim, eps=eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) the tokens' positions from 0; the trailing partial window is left out."""
        compressed = self.entries(x, [(0, x.shape[1], 0)], None)
        return compressed, self.visible(positions, compressed.shape[1])

    def visible(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        """(T, count): entry w ends at position (w + 1) x rate - 1; a query at t sees it once t + 1 >= (w + 1) rate."""
        return torch.arange(count, device=positions.device) < ((positions + 1) // self.rate)[:, None]

    def entries(self, x: torch.Tensor, spans: list[Span], chunk: SequenceChunk | None) -> torch.Tensor:
        """The whole sequence's entries (B, W, head_dim) from this rank's pieces `spans` of x (B, n, D)."""
        rate, d = self.rate, self.head_dim
        if chunk is not None and spans[0][1] % rate:
            raise ConfigError(f"DeepSeek-V4 compressed attention under context parallel compresses windows of {rate} "
                              f"tokens inside each sequence piece, but a piece holds {spans[0][1]} tokens",
                              f"choose data.seq_len a multiple of 2 x parallel.cp x {rate}")
        kv_all, gate_all = self.kv_proj(x), self.gate_proj(x)
        before: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(spans)
        if self.overlap and chunk is not None:
            # each piece's last window's first halves, gathered: piece p's predecessor is rows (p - 1) x rate onward
            tails = torch.cat([torch.cat([kv_all[:, s + n - rate:s + n, :d], gate_all[:, s + n - rate:s + n, :d]], -1)
                               for s, n, _ in spans], dim=1)
            every = _whole(tails, chunk)
            for i, (_, n, at) in enumerate(spans):
                piece = at // n
                if piece:
                    tail = every[:, (piece - 1) * rate:piece * rate]
                    before[i] = tail[..., :d], tail[..., d:]
        out = []
        for (s, n, at), prev in zip(spans, before, strict=True):
            windows = n // rate
            kv = kv_all[:, s:s + windows * rate].unflatten(1, (windows, rate))
            gate = gate_all[:, s:s + windows * rate].unflatten(1, (windows, rate)) + self.position_bias
            if self.overlap:
                if prev is None:  # no window before the sequence's first: its slots weigh 0
                    prev_kv = torch.zeros_like(kv[:, :1, :, :d])
                    prev_gate = torch.full_like(gate[:, :1, :, :d], float("-inf"))
                else:
                    prev_kv, prev_gate = prev[0][:, None], (prev[1] + self.position_bias[:, :d])[:, None]
                # slots: the previous window's first halves, then this window's second halves
                kv = torch.cat([torch.cat([prev_kv, kv[:, :-1, :, :d]], 1), kv[..., d:]], 2)
                gate = torch.cat([torch.cat([prev_gate, gate[:, :-1, :, :d]], 1), gate[..., d:]], 2)
            weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
            compressed = self.kv_norm((kv * weights).sum(dim=2).float()).to(x.dtype)
            starts = (at // rate + torch.arange(windows, device=x.device)) * rate
            cos, sin = rotary_tables(starts, self.rope_dim, self.rope_theta)
            out.append(rotate_tail(compressed, cos, sin))
        return _whole(torch.cat(out, dim=1), chunk)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressed keys (`index_dim` wide), scored against `n_heads`
    query heads from the attention's query latent, I[t, w] = sum_h g_t,h ReLU(q_t,h . k_w) / sqrt(index_dim) with
    g_t = x_t W_g / sqrt(n_heads); each query keeps its `topk` best visible entries."""

    def __init__(self, d_model: int, q_rank: int, n_heads: int, index_dim: int, topk: int, rate: int, rope_dim: int,
                 rope_theta: float, eps: float) -> None:
        super().__init__(d_model, index_dim, rate, rope_dim, rope_theta, eps, overlap=True)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_rank, n_heads * index_dim, bias=False)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, T, T // rate): True where a query keeps the entry."""
        keys = self.entries(x, [(0, x.shape[1], 0)], None)
        chosen, kept = self.chosen(x, q_latent, positions, keys)
        dense = torch.zeros(*chosen.shape[:2], keys.shape[1], dtype=torch.bool, device=x.device)
        return dense.scatter_(-1, chosen, kept)

    @torch.no_grad()
    def chosen(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, k) the entries of `keys` (B, W, index_dim) each query keeps, k = min(topk, W), and whether each is
        one it may see (a row with fewer visible entries than topk keeps only those). Top-k passes no gradient, so
        neither does the indexer."""
        cos, sin = rotary_tables(positions, self.rope_dim, self.rope_theta)
        q = rotate_tail(self.q_b_proj(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), cos[:, None],
                        sin[:, None])
        gates = self.weights_proj(x).float() * self.n_heads**-0.5
        picks, kept = [], []
        # the scores of a block of queries at a time, about INDEX_SCORES of them (one query's: heads x entries)
        step = max(1, min(CompressedAttention.query_block, INDEX_SCORES // max(1, self.n_heads * keys.shape[1])))
        for b in range(0, x.shape[1], step):
            rows = slice(b, b + step)
            scores = torch.relu(torch.einsum("bthd,bwd->bthw", q[:, rows].float(), keys.float())) * self.head_dim**-0.5
            visible = self.visible(positions[rows], keys.shape[1])
            index = (scores * gates[:, rows, :, None]).sum(dim=2).masked_fill(~visible, float("-inf"))
            chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
            picks.append(chosen)
            kept.append(visible.expand(x.shape[0], -1, -1).gather(-1, chosen))
        return torch.cat(picks, dim=1), torch.cat(kept, dim=1)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """V4 attention over a (B, T, D) input: a sliding-window branch, and with `compress_rate` the compressed entries
    beside it: all those a query may see (HCA), or with `index` = (heads, width, topk) the ones CSA's indexer picks.
    Rotary: base `rope_theta` for a sliding-only block, `compress_theta` for a compressed one (its compressor too).

    Queries run in blocks of `query_block` consecutive positions, each against its window's keys and its entries
    (CSA: the indexer's picks, gathered), so the scores kept for backward grow as T x (window + entries), never T x T.
    Under context parallel each rank's queries read the all-gathered key/value head (T x head_dim a layer) and
    entries (T / rate); every position is the token's own in the sequence."""

    query_block = 256

    def __init__(self, d_model: int, n_heads: int, head_dim: int, q_rank: int, rope_dim: int, window: int,
                 groups: int, o_rank: int, eps: float, rope_theta: float, compress_theta: float,
                 compress_rate: int | None = None, index: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.window, self.eps = n_heads, head_dim, window, eps
        self.rope_dim = rope_dim
        self.theta = rope_theta if compress_rate is None else compress_theta
        self.q_a_proj = nn.Linear(d_model, q_rank, bias=False)
        self.q_a_norm = nn.RMSNorm(q_rank, eps=eps)
        self.q_b_proj = nn.Linear(q_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(head_dim, eps=eps)
        self.output = GroupedOutputProjection(n_heads * head_dim, groups, o_rank, d_model)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor = (Compressor(d_model, head_dim, compress_rate, rope_dim, compress_theta, eps,
                                      overlap=index is not None) if compress_rate is not None else None)
        self.indexer = (Indexer(d_model, q_rank, *index, compress_rate, rope_dim, compress_theta, eps)
                        if compress_rate is not None and index is not None else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, chunk: SequenceChunk | None = None) -> torch.Tensor:
        """positions: (T,) the tokens' positions in the sequence (0, 1, ... on one rank; under context parallel
        `chunk`'s pieces)."""
        spans = _spans(x.shape[1], chunk)
        cos, sin = rotary_tables(positions, self.rope_dim, self.theta)
        latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotate_tail(_unit_rms(q, self.eps), cos[:, None], sin[:, None]).transpose(1, 2)  # (B, H, T, hd)
        # the one key and value head, every rank's in sequence order
        kv = _whole(rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin), chunk)
        entries = self.compressor.entries(x, spans, chunk) if self.compressor is not None else None
        picked = None
        if self.indexer is not None and entries is not None and entries.shape[1]:
            with torch.no_grad():  # top-k passes no gradient: nothing of the indexer's is kept for backward
                picked = self.indexer.chosen(x, latent, positions, self.indexer.entries(x, spans, chunk))
        out = torch.cat([self._attend(q[:, :, start:start + n], kv, entries, picked, s, start, n, at)
                         for s, length, at in spans
                         for start, n in self._blocks(s, length)], dim=2).transpose(1, 2)  # (B, T, H, hd)
        # keys are the values, so a value's rotary slice carries its key's angle: turn it back by the query's
        out = rotate_tail(out, cos[:, None], -sin[:, None])
        return self.output(out.flatten(-2))

    def _blocks(self, start: int, length: int) -> list[tuple[int, int]]:
        step = self.query_block
        return [(start + b, min(step, length - b)) for b in range(0, length, step)]

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None,
                picked: tuple[torch.Tensor, torch.Tensor] | None, span_start: int, start: int, n: int, at: int
                ) -> torch.Tensor:
        """The outputs (B, H, n, hd) of queries q (B, H, n, hd) at sequence positions at + (start - span_start)
        onward, against the whole sequence's keys kv (B, T, hd) and entries (B, W, hd)."""
        first = at + start - span_start
        pos = torch.arange(first, first + n, device=q.device)
        low = max(0, first - self.window + 1)
        keys = kv[:, low:first + n]  # every key of the block's windows
        distance = pos[:, None] - torch.arange(low, first + n, device=q.device)
        masks = [(distance >= 0) & (distance < self.window)]
        scale = self.head_dim**-0.5
        logits = [(q @ keys[:, None].transpose(-1, -2)) * scale]
        seen: torch.Tensor | None = None
        if entries is not None and self.compressor is not None:
            if picked is None:  # HCA: every entry the block's last query may see
                seen = entries[:, :(first + n) // self.compressor.rate]
                masks.append(self.compressor.visible(pos, seen.shape[1]))
                logits.append((q @ seen[:, None].transpose(-1, -2)) * scale)
            else:  # CSA: each query's picks, gathered (B, n, k, hd)
                chosen, kept = picked[0][:, start:start + n], picked[1][:, start:start + n]
                seen = entries[torch.arange(entries.shape[0], device=q.device)[:, None, None], chosen]
                masks.append(kept[:, None])
                logits.append(torch.einsum("bhqd,bqkd->bhqk", q, seen) * scale)
        scores = torch.cat([lg.masked_fill(~m, float("-inf")) for lg, m in zip(logits, masks, strict=True)]
                           + [self.sinks.to(q.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, n, 1)], dim=-1)
        # the sink takes its share of each softmax and contributes no value
        probs = scores.softmax(dim=-1)
        out = probs[..., :keys.shape[1]] @ keys[:, None]
        if seen is not None:
            tail = probs[..., keys.shape[1]:-1]
            out = out + (tail @ seen[:, None] if picked is None else torch.einsum("bhqk,bqkd->bhqd", tail, seen))
        return out


@dataclass
class InputsCache:
    """A V4 block's generation state: its normalised inputs so far (B, T, D); each step recomputes the branches over
    them, so a step's outputs equal the whole sequence's."""

    inputs: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.inputs is None else self.inputs.shape[1]


class V4Attention(CompressedAttention):
    """`CompressedAttention` called as a block's token mixer (`module(x, mask, rope=..., cache=..., ...)`): it
    rotates with its own tables from the tokens' positions (0, 1, ... of each unpacked sequence, padded on the right
    only)."""

    def forward(self, x: torch.Tensor, mask: Any = None, *, rope: Any = None, bias: Any = None,  # type: ignore[override]
                cache: InputsCache | None = None, chunk: Any = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # right padding leaves each row's tokens at positions 0, 1, ...: a causal query never reads the pads after it
        if padding is not None and not bool((padding == padding.cummin(dim=1).values).all()):
            raise ConfigError("DeepSeek-V4 attention blocks read every row from position 0, but this batch is "
                              "left-padded", "pad rows on the right")
        if documents is not None and bool((documents != documents[:, :1]).any()):
            raise ConfigError("DeepSeek-V4 attention blocks read one document per row, but this batch is packed",
                              "set data.packing off (one document per row)")
        if chunk is not None:
            if chunk.ulysses:
                raise ConfigError("DeepSeek-V4 attention blocks do not run under Ulysses context parallel",
                                  'use parallel.cp_method = "allgather"')
            return super().forward(x, chunk.positions(x.shape[1], x.device), chunk)
        if cache is None:
            return super().forward(x, torch.arange(x.shape[1], device=x.device))
        whole = x if cache.inputs is None else torch.cat([cache.inputs, x], dim=1)
        cache.inputs = whole
        out = super().forward(whole, torch.arange(whole.shape[1], device=x.device))
        return out[:, -x.shape[1]:]


def sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


class HashRouter(nn.Module):
    """Each token's `top_k` experts from a fixed token id -> experts table (a buffer, saved with the model); the
    gate's scores of those experts, normalised to sum 1, times `scale`, weigh them."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, vocab_size: int, scale: float) -> None:
        super().__init__()
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.experts_of_token: torch.Tensor
        self.register_buffer("experts_of_token", torch.zeros(vocab_size, top_k, dtype=torch.long))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert indices), each (B x T, top_k), for (B, T, D) inputs and their (B, T) token ids."""
        scores = sqrt_softplus(F.linear(x.flatten(0, -2), self.weight))
        indices = self.experts_of_token[ids.flatten()]
        weights = scores.gather(1, indices)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, indices


__all__ = ["CompressedAttention", "Compressor", "GroupedOutputProjection", "HashRouter", "Indexer", "InputsCache",
           "V4Attention", "rotary_tables", "rotate_tail"]
