"""The compressed keys of DeepSeek-V4's attention (`compressed_attention.py` holds the attention itself):
`Compressor` (HCA's windows of `rate` tokens, CSA's overlapping windows of 2 x rate) and CSA's lightning `Indexer`,
each with its generation state `WindowState`; the rotary helpers and the grouped output projection they share with
the attention; and the sequence pieces a rank holds under context parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.config import CompressedAttentionConfig
from meshformer.model.positions import RopeScaling, rope_frequencies
from meshformer.model.sharded import local_part

if TYPE_CHECKING:
    from meshformer.model.attention import SequenceChunk

QUERY_BLOCK = 256  # consecutive query positions the attention and the indexer's top-k take at once
INDEX_SCORES = 2**25  # float32 indexer scores (128 MiB) computed at once: one block of queries against every entry
Span = tuple[int, int, int]  # (start among this rank's tokens, length, start in the sequence): a contiguous piece

def _whole(t: torch.Tensor, chunk: SequenceChunk | None) -> torch.Tensor:
    """(B, n, D) of this rank's pieces -> (B, N, D) of every rank's, in sequence order (identity on one rank)."""
    return t if chunk is None else chunk.whole(t[:, None]).squeeze(1)


def _spans(length: int, chunk: SequenceChunk | None) -> list[Span]:
    return [(0, length, 0)] if chunk is None else chunk.spans(length)


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
        weight = local_part(self.o_a_proj).unflatten(0, (self.groups, -1))  # (G, rank, width / G)
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
        gate = gate + local_part(self.position_bias)
        if self.overlap:
            d = self.head_dim
            if prior is None:
                first_kv = torch.zeros_like(kv[:, :1, :, :d])
                first_gate = torch.full_like(gate[:, :1, :, :d], float("-inf"))
            else:
                first_kv, first_gate = prior[0][:, None], (prior[1] + local_part(self.position_bias)[:, :d])[:, None]
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

    def run_entries(self, x: torch.Tensor, chunk: SequenceChunk | None, rows: torch.Tensor, starts: torch.Tensor,
                    index: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
        """The entries (B, width, head_dim) of windows of runs that start anywhere in the sequence (packed or
        left-padded rows under context parallel): window i covers row rows[i]'s tokens starts[i] onward, is its run's
        index[i]-th (its rotary position index[i] x rate; CSA reads the previous window's first halves where
        index[i] > 0) and goes to its row's slot slots[i]. A window may straddle pieces, so the projections of this
        rank's pieces of x (B, n, D) are all-gathered whole (T x 2 x width)."""
        rate, d = self.rate, self.head_dim
        kv_all, gate_all = self.kv_proj(x), self.gate_proj(x)
        both = _whole(torch.cat([kv_all, gate_all], dim=-1), chunk)
        out = x.new_zeros(x.shape[0], width, d)
        if not len(rows):
            return out
        tokens = starts[:, None] + torch.arange(rate, device=x.device)
        kv, gate = both[rows[:, None], tokens].split(kv_all.shape[-1], dim=-1)  # (windows, rate, width)
        prior = None
        if self.overlap:  # a run's first window has no predecessor: its slots weigh 0
            before = both[rows[:, None], (tokens - rate).clamp(min=0)]
            has = (index > 0)[:, None, None]
            prior = (torch.where(has, before[..., :d], 0.0),
                     torch.where(has, before[..., kv_all.shape[-1]:kv_all.shape[-1] + d], float("-inf")))
        pooled = self.pool(kv[:, None], gate[:, None], prior)[:, 0]
        return out.index_put((rows, slots), self.rotate(pooled, index * rate))

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
        step = max(1, min(QUERY_BLOCK, INDEX_SCORES // max(1, self.n_heads * keys.shape[1])))
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

    @torch.no_grad()
    def run_chosen(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, run: torch.Tensor,
                   keys: torch.Tensor, counts: torch.Tensor, first: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """`chosen` for queries of runs that start anywhere in the sequence (packed or left-padded rows under context
        parallel): query (b, t) of run r = run[b, t] (-1: a pad, which keeps nothing) at position positions[b, t] in
        it scores exactly its run's counts[r] entries, keys' (B, W, index_dim) row b from slot first[r], and keeps
        its top min(topk, counts[r]), as its run alone would (top-k breaks ties by the length it scores over).
        Returns (B, n, k) slots of keys, k = min(topk, W), and whether each is kept."""
        batch, n = run.shape
        k = min(self.topk, keys.shape[1])
        picks = torch.zeros(batch, n, k, dtype=torch.long, device=x.device)
        kept = torch.zeros(batch, n, k, dtype=torch.bool, device=x.device)
        own = torch.where(run >= 0, counts[run.clamp(min=0)], 0)  # each query's run's entries
        for count in own.unique().tolist():
            if count == 0:
                continue
            rows, cols = (own == count).nonzero(as_tuple=True)
            take = min(self.topk, count)
            step = max(1, INDEX_SCORES // max(1, self.n_heads * count))
            for b in range(0, len(rows), step):
                r, t = rows[b:b + step], cols[b:b + step]
                slots = first[run[r, t]][:, None] + torch.arange(count, device=x.device)
                pos = positions[r, t]
                visible = self.visible(pos, count)
                index = self.score(x[r, t][None], q_latent[r, t][None], pos, keys[r[:, None], slots][None])[0]
                chosen = index.masked_fill(~visible, float("-inf")).topk(take, dim=-1).indices
                picks[r, t, :take] = slots.gather(1, chosen)
                kept[r, t, :take] = visible.gather(1, chosen)
        return picks, kept

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
