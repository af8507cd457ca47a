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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshformer.errors import ConfigError


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (tensor parallel makes it a DTensor); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


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
        weight = _local(self.o_a_proj).unflatten(0, (self.groups, -1))  # (G, rank, width / G)
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


class Compressor(nn.Module):
    """The compressed keys of a (B, T, D) input: (B, T // rate, head_dim) and the (T, T // rate) mask of the
    entries each query may see (True: visible).

    HCA (`overlap` false): entry w is the gated sum over window w's `rate` tokens. CSA (`overlap` true): every token
    projects two halves, one for its own window's entry and one for the next window's, so entry w sums over 2 x rate
    slots (window w - 1's first halves, window w's second halves; entry 0 has only its own)."""

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
        windows = x.shape[1] // self.rate
        usable = windows * self.rate
        kv = self.kv_proj(x[:, :usable]).unflatten(1, (windows, self.rate))
        gate = self.gate_proj(x[:, :usable]).unflatten(1, (windows, self.rate)) + _local(self.position_bias)
        if self.overlap:
            d, empty = self.head_dim, torch.full_like(gate[:, :1, :, :self.head_dim], float("-inf"))
            # slots: the previous window's first halves (none before window 0: weight 0), then this window's second
            kv = torch.cat([torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], 1), kv[..., d:]], 2)
            gate = torch.cat([torch.cat([empty, gate[:, :-1, :, :d]], 1), gate[..., d:]], 2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        compressed = self.kv_norm((kv * weights).sum(dim=2).float()).to(x.dtype)
        starts = torch.arange(windows, device=x.device) * self.rate
        cos, sin = rotary_tables(starts, self.rope_dim, self.rope_theta)
        compressed = rotate_tail(compressed, cos, sin)
        # entry w ends at position (w + 1) * rate - 1: a query at t sees it once t + 1 >= (w + 1) * rate
        visible = torch.arange(windows, device=x.device) < ((positions + 1) // self.rate)[:, None]
        return compressed, visible


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
        keys, visible = self(x, positions)
        cos, sin = rotary_tables(positions, self.rope_dim, self.rope_theta)
        q = rotate_tail(self.q_b_proj(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), cos[:, None],
                        sin[:, None])
        scores = torch.relu(torch.einsum("bthd,bwd->bthw", q.float(), keys.float())) * self.head_dim**-0.5
        gates = self.weights_proj(x).float() * self.n_heads**-0.5
        index = (scores * gates[..., None]).sum(dim=2).masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        kept = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, chosen, True)
        return kept & visible  # a row with fewer visible entries than topk keeps only those


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """V4 attention over a (B, T, D) input: a sliding-window branch, and with `compress_rate` the compressed entries
    beside it: all those a query may see (HCA), or with `index` = (heads, width, topk) the ones CSA's indexer picks.
    Rotary: base `rope_theta` for a sliding-only block, `compress_theta` for a compressed one (its compressor too)."""

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
        # tensor parallel (`shard_heads`): sums the shared key/value head's gradient over the ranks
        self.sum_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
        """Run rank `rank`'s heads of `ranks` (and the output groups they fill) from now on. Returns the names of its
        own parameters the caller splits on dim 0 (the sinks, o_a's groups) and of those every rank keeps whole; the
        linears are the caller's (q_b_proj colwise, o_b rowwise). The one key/value head, its compressor and the
        indexer run whole on every rank: each rank's heads give their share of the key/value head's gradient, summed
        over the ranks (`sum_gradient`), so everything upstream of it gets the whole gradient on every rank. The
        indexer only selects (no gradient reaches it), so running it whole keeps every rank's selection the
        single process's at no exchange."""
        self.n_heads //= ranks
        self.output.groups //= ranks
        self.sum_gradient = sum_gradient
        whole = [f"{name}.position_bias" for name in ("compressor", "indexer") if getattr(self, name) is not None]
        return ["sinks", "output.o_a_proj"], whole

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """positions: (T,) the tokens' positions from 0."""
        batch, length, _ = x.shape
        cos, sin = rotary_tables(positions, self.rope_dim, self.theta)
        latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotate_tail(_unit_rms(q, self.eps), cos[:, None], sin[:, None]).transpose(1, 2)  # (B, H, T, hd)
        kv = rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)  # (B, T, hd): the one key and value head
        distance = positions[:, None] - positions[None, :]
        visible = ((distance >= 0) & (distance < self.window)).expand(batch, -1, -1)
        if self.compressor is not None:
            compressed, seen = self.compressor(x, positions)
            if self.indexer is not None:
                seen = self.indexer.select(x, latent, positions)
            kv, visible = torch.cat([kv, compressed], dim=1), torch.cat([visible, seen.expand(batch, -1, -1)], dim=2)
        if self.sum_gradient is not None:
            kv = self.sum_gradient(kv)
        logits = (q @ kv[:, None].transpose(-1, -2)) * self.head_dim**-0.5
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        sink = _local(self.sinks).to(logits.dtype).view(1, -1, 1, 1).expand(batch, -1, length, 1)
        # the sink takes its share of each softmax and contributes no value
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = (probs @ kv[:, None]).transpose(1, 2)  # (B, T, H, hd)
        # keys are the values, so a value's rotary slice carries its key's angle: turn it back by the query's
        out = rotate_tail(out, cos[:, None], -sin[:, None])
        return self.output(out.flatten(-2))


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
            raise ConfigError("DeepSeek-V4 attention blocks do not run under context parallel",
                              "use parallel.cp=1")
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
