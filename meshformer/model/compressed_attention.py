"""Pieces of DeepSeek-V4's attention and routing, each checked on its own against transformers' module.

- `GroupedOutputProjection`: the heads' outputs split into groups, each projected on its own to a narrow width,
  then one projection of the concatenation to d_model (V4's o_a / o_b: far fewer weights than heads x head_dim
  to d_model).
- `Compressor`: the compressed keys (and values: V4 reads one tensor as both) of heavily compressed attention (HCA:
  every `rate` tokens become one entry, a softmax-gated sum with a learned per-slot bias, normed, its trailing rotary
  slice rotated at the window's first position) and of compressed sparse attention (CSA: overlapping windows of
  2 x rate). A query sees an entry only once its whole window lies at or before it.
- `Indexer`: CSA's lightning indexer, which keeps each query's top-k compressed entries. Its training objective
  (`index_kl`, with `[model.compressed_attention] index_loss_weight` > 0): per query, KL from the main attention's
  mass on the entries it reads (detached, summed over the heads, normalised over them) to the indexer's softmax
  over the same entries, computed per query block from detached inputs, so only the indexer learns from it; handed
  to the objective as "csa/indexer_loss" (`LayerTerms`, as DSA's). model.dsa.stage = "warmup" attends to every
  visible entry and trains only the indexers.
- `CompressedAttention`: V4's attention (whole-sequence path): one shared key/value head (MQA, keys are values),
  queries through a normed low-rank latent and an unweighted per-head RMSNorm, rotary on each head's trailing slice,
  a sliding window over the tokens plus, in HCA blocks, every compressed entry a query may see; a learned sink logit
  per head; the output's rotary slice turned back by its query's angle, then the grouped output projection.
  `V4Attention` is the block-facing module of the token-mixer kinds "sliding_mqa", "hca" and "csa"
  (model/components/v4_attention.py): left-padded and packed rows read as runs of one document's real tokens, and
  `V4Cache`, the incremental generation cache (the window's keys, each compressor's `WindowState`).
- `HashRouter`: the first blocks' MoE routing: each token's experts are a fixed table's row for its token id; the
  learned gate only weighs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from meshformer.errors import ConfigError
from meshformer.loss.layer_terms import LayerTerms
from meshformer.model.config import CompressedAttentionConfig
from meshformer.model.positions import RopeScaling, rope_frequencies

if TYPE_CHECKING:
    from meshformer.model.attention import SequenceChunk

INDEX_LOSS = "csa/indexer_loss"  # the objective's name of the CSA indexer's loss term
INDEX_SCORES = 2**25  # float32 indexer scores (128 MiB) computed at once: one block of queries against every entry
Span = tuple[int, int, int]  # (start among this rank's tokens, length, start in the sequence): a contiguous piece


def _whole(t: torch.Tensor, chunk: SequenceChunk | None) -> torch.Tensor:
    """(B, n, D) of this rank's pieces -> (B, N, D) of every rank's, in sequence order (identity on one rank)."""
    return t if chunk is None else chunk.whole(t[:, None]).squeeze(1)


def _spans(length: int, chunk: SequenceChunk | None) -> list[Span]:
    return [(0, length, 0)] if chunk is None else chunk.spans(length)


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


def rotary_tables(positions: torch.Tensor, dim: int, theta: float, scaling: RopeScaling | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., dim / 2) of one angle per rotated pair (pairs of neighbouring channels); `scaling`: the
    compressed blocks' YaRN, whose cos/sin stay unmultiplied (V4 sets its attention factor to 1)."""
    if scaling is None or scaling.method == "none":
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    else:
        inv_freq = rope_frequencies(dim, theta, scaling, positions.device)[0].float()
    angles = positions[..., None].float() * inv_freq
    return angles.cos(), angles.sin()


def compress_scaling(c: CompressedAttentionConfig) -> RopeScaling | None:
    """The compressed blocks' YaRN of `[model.compressed_attention]` (None: unscaled); its attention factor 1, as V4
    leaves cos/sin unmultiplied."""
    if c.yarn_factor == 1:
        return None
    return RopeScaling("yarn", c.yarn_factor, c.yarn_original_max_seq_len, beta_fast=c.yarn_beta_fast,
                       beta_slow=c.yarn_beta_slow, attention_factor=1.0)


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
    slots (window w - 1's first halves, window w's second halves; entry 0 has only its own).

    Under context parallel (`entries` with a `SequenceChunk`) each rank compresses the windows of its own pieces
    (a piece's length must be a multiple of `rate`, so no window straddles two pieces); CSA's first window of a
    piece reads the previous piece's last window, whose first halves every rank all-gathers (rate tokens a piece),
    and the entries are all-gathered in sequence order (T / rate of them)."""

    def __init__(self, d_model: int, head_dim: int, rate: int, rope_dim: int, rope_theta: float, eps: float,
                 overlap: bool = False, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.rate, self.rope_dim, self.rope_theta, self.overlap = rate, rope_dim, rope_theta, overlap
        self.scaling = scaling
        self.head_dim = head_dim
        width = 2 * head_dim if overlap else head_dim
        self.kv_proj = nn.Linear(d_model, width, bias=False)
        self.gate_proj = nn.Linear(d_model, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))  # one gate bias per slot of a window
        self.kv_norm = nn.RMSNorm(head_dim, eps=eps)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, prior: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> torch.Tensor:
        """(B, n, head_dim) entries, normed and not yet rotated, of n whole windows' projections kv, gate
        (B, n, rate, width; gate without the slot bias). prior: the first halves (kv, gate: B, rate, head_dim) of the
        window before the first (overlap); None: there is none (those slots weigh 0)."""
        gate = gate + _local(self.position_bias)
        if self.overlap:
            d = self.head_dim
            if prior is None:
                first_kv = torch.zeros_like(kv[:, :1, :, :d])
                first_gate = torch.full_like(gate[:, :1, :, :d], float("-inf"))
            else:
                first_kv, first_gate = prior[0][:, None], (prior[1] + _local(self.position_bias)[:, :d])[:, None]
            # slots: the previous window's first halves, then this window's second
            kv = torch.cat([torch.cat([first_kv, kv[:, :-1, :, :d]], 1), kv[..., d:]], 2)
            gate = torch.cat([torch.cat([first_gate, gate[:, :-1, :, :d]], 1), gate[..., d:]], 2)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=2).float()).to(kv.dtype)

    def rotate(self, pooled: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """Entries' rotary slices turned by their windows' first positions `starts` (pooled's leading shape)."""
        cos, sin = rotary_tables(starts, self.rope_dim, self.rope_theta, self.scaling)
        return rotate_tail(pooled, cos, sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: dict[str, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) the tokens' positions from 0; the trailing partial window is left out. keep: filled with
        the projections ("kv", "gate") and the entries, for a generation cache to start from."""
        windows = x.shape[1] // self.rate
        usable = windows * self.rate
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if windows:
            pooled = self.pool(kv[:, :usable].unflatten(1, (windows, self.rate)),
                               gate[:, :usable].unflatten(1, (windows, self.rate)))
            compressed = self.rotate(pooled, torch.arange(windows, device=x.device) * self.rate)
        else:
            compressed = x.new_zeros(x.shape[0], 0, self.head_dim)
        if keep is not None:
            keep.update(kv=kv, gate=gate, entries=compressed)
        # entry w ends at position (w + 1) * rate - 1: a query at t sees it once t + 1 >= (w + 1) * rate
        visible = torch.arange(windows, device=x.device) < ((positions + 1) // self.rate)[:, None]
        return compressed, visible

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
        for (s, n, at), prior in zip(spans, before, strict=True):
            windows = n // rate
            if not windows:
                continue
            pooled = self.pool(kv_all[:, s:s + windows * rate].unflatten(1, (windows, rate)),
                               gate_all[:, s:s + windows * rate].unflatten(1, (windows, rate)), prior)
            out.append(self.rotate(pooled, (at // rate + torch.arange(windows, device=x.device)) * rate))
        if not out:
            return x.new_zeros(x.shape[0], 0, d)
        return _whole(torch.cat(out, dim=1), chunk)

    def start(self, batch: int, like: torch.Tensor) -> WindowState:
        """An empty generation state of `batch` rows."""
        width, d = self.kv_proj.out_features, self.head_dim
        rows = torch.zeros(batch, dtype=torch.long, device=like.device)
        return WindowState(kv=like.new_zeros(batch, self.rate, width), gate=like.new_zeros(batch, self.rate, width),
                           filled=rows, entries=like.new_zeros(batch, 0, d), count=rows.clone(),
                           prior_kv=like.new_zeros(batch, self.rate, d) if self.overlap else None,
                           prior_gate=like.new_full((batch, self.rate, d), float("-inf")) if self.overlap else None)

    def fill(self, state: WindowState, rows: torch.Tensor, keep: dict[str, torch.Tensor]) -> None:
        """Set `rows` of `state` from a whole-sequence pass over their (equally long) tokens (`keep`)."""
        length, entries = keep["kv"].shape[1], keep["entries"]
        whole = entries.shape[1] * self.rate
        if entries.shape[1] > state.entries.shape[1]:
            state.entries = torch.cat([state.entries, state.entries.new_zeros(
                state.entries.shape[0], entries.shape[1] - state.entries.shape[1], self.head_dim)], 1)
        state.entries[rows, :entries.shape[1]] = entries
        state.count[rows] = entries.shape[1]
        state.kv[rows, :length - whole] = keep["kv"][:, whole:]
        state.gate[rows, :length - whole] = keep["gate"][:, whole:]
        state.filled[rows] = length - whole
        if state.prior_kv is not None and state.prior_gate is not None and whole:
            last = slice(whole - self.rate, whole)
            state.prior_kv[rows] = keep["kv"][:, last, :self.head_dim]
            state.prior_gate[rows] = keep["gate"][:, last, :self.head_dim]

    def step(self, state: WindowState, x: torch.Tensor) -> None:
        """Feed one token per row (B, D): it fills its row's next slot; a row whose window fills up gains its
        entry and starts the next window. Work per token: one window, whatever the length."""
        rows = torch.arange(x.shape[0], device=x.device)
        state.kv[rows, state.filled] = self.kv_proj(x)
        state.gate[rows, state.filled] = self.gate_proj(x)
        state.filled = state.filled + 1
        done = state.filled == self.rate
        if not bool(done.any()):
            return
        prior = None if state.prior_kv is None or state.prior_gate is None else (state.prior_kv, state.prior_gate)
        entry = self.rotate(self.pool(state.kv[:, None], state.gate[:, None], prior)[:, 0], state.count * self.rate)
        if int(state.count.max()) >= state.entries.shape[1]:
            state.entries = torch.cat([state.entries, state.entries.new_zeros(x.shape[0], 1, self.head_dim)], 1)
        state.entries[rows[done], state.count[done]] = entry[done]
        state.count = state.count + done.long()
        if prior is not None:
            state.prior_kv = torch.where(done[:, None, None], state.kv[..., :self.head_dim], prior[0])
            state.prior_gate = torch.where(done[:, None, None], state.gate[..., :self.head_dim], prior[1])
        state.filled = state.filled.masked_fill(done, 0)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressed keys (`index_dim` wide), scored against `n_heads`
    query heads from the attention's query latent, I[t, w] = sum_h g_t,h ReLU(q_t,h . k_w) / sqrt(index_dim) with
    g_t = x_t W_g / sqrt(n_heads); each query keeps its `topk` best visible entries."""

    def __init__(self, d_model: int, q_rank: int, n_heads: int, index_dim: int, topk: int, rate: int, rope_dim: int,
                 rope_theta: float, eps: float, scaling: RopeScaling | None = None) -> None:
        super().__init__(d_model, index_dim, rate, rope_dim, rope_theta, eps, overlap=True, scaling=scaling)
        self.n_heads, self.topk = n_heads, topk
        self.q_b_proj = nn.Linear(q_rank, n_heads * index_dim, bias=False)
        self.weights_proj = nn.Linear(d_model, n_heads, bias=False)

    def score(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
              ) -> torch.Tensor:
        """(B, T, W): each query's index score of each entry of keys (B, W, index_dim), or of its own entries
        (keys: B, T, W, index_dim). positions: (T,) or (B, T)."""
        cos, sin = rotary_tables(positions, self.rope_dim, self.rope_theta, self.scaling)
        q = rotate_tail(self.q_b_proj(q_latent).unflatten(-1, (self.n_heads, self.head_dim)), cos.unsqueeze(-2),
                        sin.unsqueeze(-2))
        pattern = "bthd,bwd->bthw" if keys.dim() == 3 else "bthd,btwd->bthw"
        scores = torch.relu(torch.einsum(pattern, q.float(), keys.float())) * self.head_dim**-0.5
        gates = self.weights_proj(x).float() * self.n_heads**-0.5
        return (scores * gates[..., None]).sum(dim=2)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor,
               keep: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """(B, T, T // rate): True where a query keeps the entry."""
        keys, visible = self(x, positions, keep)
        index = self.score(x, q_latent, positions, keys).masked_fill(~visible, float("-inf"))
        chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        kept = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, chosen, True)
        return kept & visible  # a row with fewer visible entries than topk keeps only those

    @torch.no_grad()
    def chosen(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, k) the entries of `keys` (B, W, index_dim) each query keeps, k = min(topk, W), and whether each is
        one it may see (a row with fewer visible entries than topk keeps only those). Top-k passes no gradient, so
        neither does the indexer. Scores of a block of queries at a time, about INDEX_SCORES of them."""
        step = max(1, min(CompressedAttention.query_block, INDEX_SCORES // max(1, self.n_heads * keys.shape[1])))
        picks, kept = [], []
        for b in range(0, x.shape[1], step):
            rows = slice(b, b + step)
            visible = self.visible(positions[rows], keys.shape[1])
            index = self.score(x[:, rows], q_latent[:, rows], positions[rows], keys).masked_fill(~visible,
                                                                                                  float("-inf"))
            chosen = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
            picks.append(chosen)
            kept.append(visible.expand(x.shape[0], -1, -1).gather(-1, chosen))
        return torch.cat(picks, dim=1), torch.cat(kept, dim=1)

    def pick(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, state: WindowState
             ) -> torch.Tensor:
        """(B, 1, E) for one query per row (x: B, 1, D) over the state's entries: its top-k of its row's entries.
        The top-k runs over exactly each row's entries, as a row decoded alone would (top-k breaks ties, such as
        the exact zeros ReLU leaves, by the length it scores over)."""
        index = self.score(x, q_latent, positions, state.entries)
        kept = torch.zeros_like(index, dtype=torch.bool)
        for count in state.count.unique().tolist():
            if count == 0:
                continue
            rows = (state.count == count).nonzero()[:, 0]
            chosen = index[rows, :, :count].topk(min(self.topk, count), dim=-1).indices
            kept[rows] = kept[rows].scatter(-1, chosen, True)
        return kept


@dataclass
class WindowState:
    """A compressor's generation state: each row's unfinished window and its finished entries."""

    kv: torch.Tensor  # (B, rate, width): the projections of the unfinished window's tokens, from slot 0
    gate: torch.Tensor  # (B, rate, width): their gates, without the slot bias
    filled: torch.Tensor  # (B,): slots filled
    entries: torch.Tensor  # (B, E, head_dim): finished entries, rotated; row b's first count[b] are real
    count: torch.Tensor  # (B,)
    prior_kv: torch.Tensor | None  # (B, rate, head_dim): overlap: the last finished window's first halves
    prior_gate: torch.Tensor | None  # (B, rate, head_dim): their gates (-inf: no finished window yet)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """V4 attention over a (B, T, D) input: a sliding-window branch, and with `compress_rate` the compressed entries
    beside it: all those a query may see (HCA), or with `index` = (heads, width, topk) the ones CSA's indexer picks.
    Rotary: base `rope_theta` for a sliding-only block, `compress_theta` and `compress_scaling` (YaRN) for a
    compressed one (its compressor and indexer too).

    Queries run in blocks of `query_block` consecutive positions, each against its window's keys and its entries
    (CSA: the indexer's picks, gathered), so the scores kept for backward grow as T x (window + entries), never T x T
    (a generation cache's prefill, `keep`, runs the whole sequence at once). Under context parallel each rank's
    queries read the all-gathered key/value head (T x head_dim a layer) and entries (T / rate); every position is
    the token's own in the sequence."""

    query_block = 256

    def __init__(self, d_model: int, n_heads: int, head_dim: int, q_rank: int, rope_dim: int, window: int,
                 groups: int, o_rank: int, eps: float, rope_theta: float, compress_theta: float,
                 compress_rate: int | None = None, index: tuple[int, int, int] | None = None,
                 compress_scaling: RopeScaling | None = None, dense: bool = False) -> None:
        """dense: the indexer's warm-up (CSA): every visible entry is attended, the indexer only learns."""
        super().__init__()
        self.n_heads, self.head_dim, self.window, self.eps = n_heads, head_dim, window, eps
        self.rope_dim = rope_dim
        self.theta = rope_theta if compress_rate is None else compress_theta
        self.scaling = None if compress_rate is None else compress_scaling
        self.q_a_proj = nn.Linear(d_model, q_rank, bias=False)
        self.q_a_norm = nn.RMSNorm(q_rank, eps=eps)
        self.q_b_proj = nn.Linear(q_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(head_dim, eps=eps)
        self.output = GroupedOutputProjection(n_heads * head_dim, groups, o_rank, d_model)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor = (Compressor(d_model, head_dim, compress_rate, rope_dim, compress_theta, eps,
                                      overlap=index is not None, scaling=compress_scaling)
                           if compress_rate is not None else None)
        self.indexer = (Indexer(d_model, q_rank, *index, compress_rate, rope_dim, compress_theta, eps,
                                compress_scaling)
                        if compress_rate is not None and index is not None else None)
        # tensor parallel (`shard_heads`): sums the shared key/value head's gradient over the ranks
        self.sum_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.dense = dense and self.indexer is not None
        # the objective's weight of the indexer loss (INDEX_LOSS; 0 or none: not computed) and its scale, 1 / the
        # step's target tokens, set before each step (None outside a step: 1 / this call's counted queries)
        self.loss_terms = LayerTerms()
        # the indexer loss summed over the counted queries and their count since the layer's last forward began
        self._loss_sum: torch.Tensor | None = None
        self._loss_count: torch.Tensor | None = None

    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
        """Run rank `rank`'s heads of `ranks` (and the output groups they fill) from now on. Returns the names of its
        own parameters the caller splits on dim 0 (the sinks, o_a's groups) and of those every rank keeps whole; the
        linears are the caller's (q_b_proj colwise, o_b rowwise). The one key/value head, its compressor and the
        indexer run whole on every rank: each rank's heads give their share of the key/value head's gradient, summed
        over the ranks (`sum_gradient`), so everything upstream of it gets the whole gradient on every rank. The
        indexer only selects (no gradient reaches it; its objective is refused here), so running it whole keeps every
        rank's selection the single process's at no exchange."""
        self.n_heads //= ranks
        self.output.groups //= ranks
        self.sum_gradient = sum_gradient
        whole = [f"{name}.position_bias" for name in ("compressor", "indexer") if getattr(self, name) is not None]
        return ["sinks", "output.o_a_proj"], whole

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The query latent, the queries (B, H, T, hd) and the one key/value head (B, T, hd), rotated."""
        latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(latent).unflatten(-1, (self.n_heads, self.head_dim))
        q = rotate_tail(_unit_rms(q, self.eps), cos.unsqueeze(-2), sin.unsqueeze(-2)).transpose(1, 2)
        return latent, q, rotate_tail(self.kv_norm(self.kv_proj(x)), cos, sin)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Queries (B, H, T, hd) over keys = values (B, K, hd) where `visible` (B, T, K), with the sinks; the output
        projected."""
        batch, length = q.shape[0], q.shape[2]
        if self.sum_gradient is not None:
            kv = self.sum_gradient(kv)
        logits = (q @ kv[:, None].transpose(-1, -2)) * self.head_dim**-0.5
        logits = logits.masked_fill(~visible[:, None], float("-inf"))
        sink = _local(self.sinks).to(logits.dtype).view(1, -1, 1, 1).expand(batch, -1, length, 1)
        # the sink takes its share of each softmax and contributes no value
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = (probs @ kv[:, None]).transpose(1, 2)  # (B, T, H, hd)
        # keys are the values, so a value's rotary slice carries its key's angle: turn it back by the query's
        out = rotate_tail(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
        return self.output(out.flatten(-2))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: dict[str, Any] | None = None, *,
                chunk: SequenceChunk | None = None, real: torch.Tensor | None = None) -> torch.Tensor:
        """positions: (T,) the tokens' positions in the sequence (0, 1, ...; under context parallel `chunk`'s
        pieces). keep: filled with the keys and the compressor's and indexer's projections and entries, for a
        generation cache to start from. real: (B, T) the queries the indexer loss counts (None: every one)."""
        if keep is None:
            return self._blockwise(x, positions, chunk, real)
        batch = x.shape[0]
        cos, sin = rotary_tables(positions, self.rope_dim, self.theta, self.scaling)
        latent, q, kv = self._project(x, cos, sin)
        if keep is not None:
            keep["keys"] = kv
        distance = positions[:, None] - positions[None, :]
        visible = ((distance >= 0) & (distance < self.window)).expand(batch, -1, -1)
        if self.compressor is not None:
            compressed, seen = self.compressor(x, positions, None if keep is None else keep.setdefault("compressor",
                                                                                                     {}))
            if self.indexer is not None:
                seen = self.indexer.select(x, latent, positions,
                                           None if keep is None else keep.setdefault("indexer", {}))
            kv, visible = torch.cat([kv, compressed], dim=1), torch.cat([visible, seen.expand(batch, -1, -1)], dim=2)
        return self._attend(q, kv, visible, cos, sin)


    def learns_index(self) -> bool:
        """Whether this forward computes the indexer loss: training, with grad, and the objective weighs it."""
        return (self.indexer is not None and self.training and torch.is_grad_enabled()
                and bool(self.loss_terms.weights.get(INDEX_LOSS)))

    def _blockwise(self, x: torch.Tensor, positions: torch.Tensor, chunk: SequenceChunk | None,
                   real: torch.Tensor | None = None) -> torch.Tensor:
        spans = _spans(x.shape[1], chunk)
        cos, sin = rotary_tables(positions, self.rope_dim, self.theta, self.scaling)
        latent, q, kv = self._project(x, cos, sin)
        kv = _whole(kv, chunk)  # the one key and value head, every rank's in sequence order
        entries = self.compressor.entries(x, spans, chunk) if self.compressor is not None else None
        if self.sum_gradient is not None:  # tensor parallel: every rank's heads read the whole key/value head
            if entries is None:
                kv = self.sum_gradient(kv)
            else:
                joined = self.sum_gradient(torch.cat([kv, entries], dim=1))  # one all-reduce in backward
                kv, entries = joined[:, :kv.shape[1]], joined[:, kv.shape[1]:]
        picked, learn = None, None
        if self.indexer is not None and entries is not None and entries.shape[1]:
            if self.learns_index():
                if self.sum_gradient is not None:
                    raise ConfigError("the csa indexer loss reads every head's attention, but tensor parallel splits "
                                      "the heads over ranks", "set model.compressed_attention.index_loss_weight = 0 "
                                      "or parallel.tp = 1")
                # the indexer learns from its own loss only: its inputs leave the model's graph
                x_in, latent_in = x.detach(), latent.detach()
                learn = _IndexInputs(x_in, latent_in, self.indexer.entries(x_in, spans, chunk), real)
            if not self.dense:
                with torch.no_grad():  # top-k passes no gradient: its own scores are kept for no backward
                    keys = learn.keys.detach() if learn is not None else self.indexer.entries(x, spans, chunk)
                    picked = self.indexer.chosen(x, latent, positions, keys)
        blocks = [self._attend_block(q[:, :, start:start + n], kv, entries, picked, s, start, n, at, learn)
                  for s, length, at in spans
                  for start, n in self._blocks(s, length)]
        out = torch.cat([o for o, _ in blocks], dim=2).transpose(1, 2)  # (B, T, H, hd)
        # keys are the values, so a value's rotary slice carries its key's angle: turn it back by the query's
        out = rotate_tail(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
        out = self.output(out.flatten(-2))
        losses = [loss for _, loss in blocks if loss is not None]
        if not losses:
            return out
        total = torch.stack([t for t, _ in losses]).sum()
        count = torch.stack([c for _, c in losses]).sum()
        self._loss_sum = total.detach() if self._loss_sum is None else self._loss_sum + total.detach()
        self._loss_count = count if self._loss_count is None else self._loss_count + count
        return self.loss_terms.add(out, {INDEX_LOSS: total}, 1 / count.clamp(min=1))

    def start_forward(self) -> None:
        """Forget the indexer loss of the previous forward (one layer call may run several passes)."""
        self._loss_sum = self._loss_count = None

    def term_values(self) -> dict[str, torch.Tensor]:
        """The latest training forward's indexer loss (mean KL per counted query: those that see an entry), for
        the objective's logged parts; none before one, without an indexer or with the loss off."""
        if self._loss_sum is None or self._loss_count is None:
            return {}
        return {INDEX_LOSS: self._loss_sum / self._loss_count.clamp(min=1)}

    def _blocks(self, start: int, length: int) -> list[tuple[int, int]]:
        step = self.query_block
        return [(start + b, min(step, length - b)) for b in range(0, length, step)]

    def _attend_block(self, q: torch.Tensor, kv: torch.Tensor, entries: torch.Tensor | None,
                      picked: tuple[torch.Tensor, torch.Tensor] | None, span_start: int, start: int, n: int, at: int,
                      learn: _IndexInputs | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The outputs (B, H, n, hd) of queries q (B, H, n, hd) at sequence positions at + (start - span_start)
        onward, against the whole sequence's keys kv (B, T, hd) and entries (B, W, hd); with `learn`, the indexer
        loss of the block's queries (summed KL, counted queries)."""
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
                           + [_local(self.sinks).to(q.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, n, 1)],
                           dim=-1)
        # the sink takes its share of each softmax and contributes no value
        probs = scores.softmax(dim=-1)
        out = probs[..., :keys.shape[1]] @ keys[:, None]
        if seen is None:
            return out, None
        tail = probs[..., keys.shape[1]:-1]
        out = out + (tail @ seen[:, None] if picked is None else torch.einsum("bhqk,bqkd->bhqd", tail, seen))
        if learn is None or self.indexer is None:
            return out, None
        rows = slice(start, start + n)
        if picked is None:  # the warm-up: every entry the block's queries may see
            keys_in = learn.keys[:, :seen.shape[1]]
        else:  # the picks' indexer keys (B, n, k, index_dim)
            keys_in = learn.keys[torch.arange(q.shape[0], device=q.device)[:, None, None], picked[0][:, rows]]
        scores = self.indexer.score(learn.x[:, rows], learn.latent[:, rows], pos, keys_in)
        real = None if learn.real is None else learn.real[:, rows]
        allowed = masks[-1].expand_as(scores) if picked is None else picked[1][:, rows]
        return out, index_kl(tail.detach(), scores, allowed, real)


@dataclass
class _IndexInputs:
    """What the indexer loss reads of a forward (detached from the model): the inputs x (B, T, D), the query latent
    (B, T, q_rank), the indexer's keys of every entry (B, W, index_dim, with grad) and the counted queries (B, T)."""

    x: torch.Tensor
    latent: torch.Tensor
    keys: torch.Tensor
    real: torch.Tensor | None


def index_kl(probs: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, real: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL, counted queries) of the CSA indexer loss over one block of queries. probs (B, H, n, E): the main
    attention's probabilities on the E entries the queries read (no gradient); scores (B, n, E): the indexer's;
    allowed (B, n, E): the entries each query reads. Per query the target p is the heads' summed mass on its entries
    normalised over them, and its loss KL(p || softmax of the scores over the same entries). A query is counted when
    it reads an entry (and is real: `real` (B, n))."""
    mass = probs.float().sum(dim=1).masked_fill(~allowed, 0.0)  # (B, n, E)
    total = mass.sum(dim=-1, keepdim=True)
    counted = total[..., 0] > 0
    if real is not None:
        counted = counted & real.to(counted.device).bool()
    p = mass / total.clamp(min=1e-30)
    log_q = torch.log_softmax(scores.float().masked_fill(~allowed, float("-inf")), dim=-1)
    # KL(p || q) = sum p log p - sum p log q; the first term is a constant of the indexer
    kl = torch.where(p > 0, p * (p.clamp(min=1e-30).log() - log_q), 0.0).sum(dim=-1)  # (B, n)
    return torch.where(counted, kl, 0.0).sum(), counted.sum().float()


@dataclass
class V4Cache:
    """A V4 block's generation state per row: the last window - 1 keys (one head, keys are values), the
    compressor's and the indexer's `WindowState`, the next position. A step reads the window and the entries only.
    Rows of a left-padded prompt keep their real tokens only, each from position 0."""

    keys: torch.Tensor | None = None  # (B, window - 1, hd), the newest last
    real: torch.Tensor | None = None  # (B, window - 1): False where a row has no such key yet
    positions: torch.Tensor | None = None  # (B,): each row's next position
    compressor: WindowState | None = None
    indexer: WindowState | None = None
    length: int = 0  # tokens fed, pads included


def _segments(padding: torch.Tensor | None, documents: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, first tokens, lengths) of each run of a row's real tokens within one document."""
    if padding is not None:
        real = padding.bool()
    elif documents is not None:
        real = torch.ones_like(documents, dtype=torch.bool)
    else:
        raise ValueError("runs are read from padding or documents")
    doc = torch.zeros_like(real, dtype=torch.long) if documents is None else documents
    after = torch.ones_like(real[:, :1])
    starts = real & torch.cat([after, ~real[:, :-1] | (doc[:, 1:] != doc[:, :-1])], 1)
    ends = real & torch.cat([~real[:, 1:] | (doc[:, 1:] != doc[:, :-1]), after], 1)
    rows, firsts = starts.nonzero(as_tuple=True)
    return rows, firsts, ends.nonzero(as_tuple=True)[1] - firsts + 1


class V4Attention(CompressedAttention):
    """`CompressedAttention` called as a block's token mixer (`module(x, mask, rope=..., cache=..., ...)`): it
    rotates with its own tables from the tokens' positions, 0, 1, ... from each row's first real token and from
    each packed document's start. A left-padded or packed row is read as its runs of real tokens of one document,
    each computed as if alone (its compression windows start with it); right padding is read in place (a causal
    query never reads the pads after it)."""

    def forward(self, x: torch.Tensor, mask: Any = None, *, rope: Any = None, bias: Any = None,  # type: ignore[override]
                cache: V4Cache | None = None, chunk: Any = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        if padding is not None and bool((padding[:, 1:] & ~padding[:, :-1]).sum(1).gt(1 - padding[:, 0].long()).any()):
            raise ConfigError("DeepSeek-V4 attention blocks read pads at a row's start or end, but a row has pads "
                              "between its tokens", "pad rows on the left or the right only")
        packed = documents is not None and bool((documents != documents[:, :1]).any())
        right_padded = padding is None or bool((padding == padding.cummin(dim=1).values).all())
        self.start_forward()
        # right padding is read in place: its pads are queries the indexer loss does not count
        real = padding if padding is not None and padding.shape[:2] == x.shape[:2] else None
        if chunk is not None:
            if chunk.ulysses:
                raise ConfigError("DeepSeek-V4 attention blocks do not run under Ulysses context parallel",
                                  'use parallel.cp_method = "allgather"')
            if packed or not right_padded:  # this rank's pieces hold parts of runs that start elsewhere
                raise ConfigError("DeepSeek-V4 attention blocks under context parallel read rows from their first "
                                  "position, but this batch is left-padded or packed",
                                  "pad rows on the right, one document per row (data.packing off)")
            return super().forward(x, chunk.positions(x.shape[1], x.device), chunk=chunk, real=real)
        if cache is not None and packed:
            raise ConfigError("DeepSeek-V4 attention blocks decode one document per row, but these rows are packed",
                              "generate from one document per row")
        if cache is not None and cache.length:
            if padding is not None and not bool(padding.all()):
                raise ConfigError("DeepSeek-V4 attention blocks read padding in the prompt only, but a decoded step "
                                  "holds pads", "pad the prompts on the left and decode real tokens after them")
            return torch.cat([self._step(x[:, t], cache) for t in range(x.shape[1])], dim=1)
        if cache is None and right_padded and not packed:
            return super().forward(x, torch.arange(x.shape[1], device=x.device), real=real)
        if cache is not None and (padding is None or bool(padding.all())):
            rows, firsts = torch.arange(x.shape[0], device=x.device), x.new_zeros(x.shape[0], dtype=torch.long)
            lengths = torch.full_like(firsts, x.shape[1])
        else:
            rows, firsts, lengths = _segments(padding, documents)
        if cache is not None:
            self._start(cache, x)
        out = torch.zeros_like(x)
        # runs of one length at once: each run's top-k then scores over its own length, as it would alone
        for length in lengths.unique().tolist():
            chosen = (lengths == length).nonzero()[:, 0]
            tokens = firsts[chosen, None] + torch.arange(length, device=x.device)
            where = (rows[chosen, None].expand_as(tokens), tokens)
            keep: dict[str, Any] | None = {} if cache is not None else None
            part = super().forward(x[where], torch.arange(length, device=x.device), keep)
            out = out.index_put(where, part)
            if cache is not None and keep is not None:
                self._fill(cache, rows[chosen], keep)
        if cache is not None:
            cache.length = x.shape[1]
        return out

    def _start(self, cache: V4Cache, x: torch.Tensor) -> None:
        batch, kept = x.shape[0], self.window - 1
        cache.keys = x.new_zeros(batch, kept, self.head_dim)
        cache.real = torch.zeros(batch, kept, dtype=torch.bool, device=x.device)
        cache.positions = torch.zeros(batch, dtype=torch.long, device=x.device)
        cache.compressor = None if self.compressor is None else self.compressor.start(batch, x)
        cache.indexer = None if self.indexer is None else self.indexer.start(batch, x)

    def _fill(self, cache: V4Cache, rows: torch.Tensor, keep: dict[str, Any]) -> None:
        """Set `rows` of the cache from a whole-sequence pass over their equally long real tokens."""
        assert cache.keys is not None and cache.real is not None and cache.positions is not None
        keys = keep["keys"]
        length = keys.shape[1]
        kept = min(self.window - 1, length)
        if kept:
            cache.keys[rows, -kept:] = keys[:, length - kept:]
            cache.real[rows, -kept:] = True
        cache.positions[rows] = length
        if self.compressor is not None and cache.compressor is not None:
            self.compressor.fill(cache.compressor, rows, keep["compressor"])
        if self.indexer is not None and cache.indexer is not None:
            self.indexer.fill(cache.indexer, rows, keep["indexer"])

    def _step(self, x: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        """One token per row (B, D) -> (B, 1, D), reading the window and the entries."""
        assert cache.keys is not None and cache.real is not None and cache.positions is not None
        positions = cache.positions[:, None]
        cos, sin = rotary_tables(positions, self.rope_dim, self.theta, self.scaling)  # (B, 1, rope / 2)
        latent, q, kv = self._project(x[:, None], cos, sin)
        keys = torch.cat([cache.keys, kv], dim=1)
        visible = torch.cat([cache.real, torch.ones_like(cache.real[:, :1])], dim=1)
        cache.keys, cache.real = keys[:, 1:], visible[:, 1:]
        if self.compressor is not None and cache.compressor is not None:
            state = cache.compressor
            self.compressor.step(state, x)
            seen = torch.arange(state.entries.shape[1], device=x.device) < state.count[:, None]
            if self.indexer is not None and cache.indexer is not None:
                self.indexer.step(cache.indexer, x)
                seen = self.indexer.pick(x[:, None], latent, positions, cache.indexer)[:, 0]
            keys, visible = torch.cat([keys, state.entries], dim=1), torch.cat([visible, seen], dim=1)
        cache.positions = cache.positions + 1
        cache.length += 1
        return self._attend(q, keys, visible[:, None], cos, sin)


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


__all__ = [
    "CompressedAttention",
    "Compressor",
    "GroupedOutputProjection",
    "HashRouter",
    "Indexer",
    "V4Attention",
    "V4Cache",
    "WindowState",
    "compress_scaling",
    "index_kl",
    "rotary_tables",
    "rotate_tail",
]
