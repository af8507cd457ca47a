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

from meshformer.errors import ConfigError
from meshformer.loss.layer_terms import LayerTerms
from meshformer.model.compressors import (
    QUERY_BLOCK,
    Compressor,
    GroupedOutputProjection,
    Indexer,
    WindowState,
    _spans,
    _whole,
    compress_scaling,
    rotary_tables,
    rotate_tail,
)
from meshformer.model.document_runs import Runs, Windows, segments
from meshformer.model.positions import RopeScaling
from meshformer.model.sharded import local_part

if TYPE_CHECKING:
    from meshformer.model.attention import SequenceChunk

INDEX_LOSS = "csa/indexer_loss"  # the objective's name of the CSA indexer's loss term


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
    the token's own in the sequence (over `runs`, its place in its run). Under Ulysses the queries go to this rank's
    heads over the whole sequence and back; the key/value head, the entries and CSA's picks are all-gathered alike,
    and the indexer loss sums its target over the cp ranks' heads and counts this rank's own queries only."""

    query_block = QUERY_BLOCK

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
        # tensor parallel (the style sets it): sums a detached tensor over the ranks in the forward (the indexer
        # loss's target, the heads' mass on each entry, of which each rank holds its heads' share)
        self.sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None
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
        indexer selects (top-k passes no gradient), so running it whole keeps every rank's selection the single
        process's at no exchange; its objective's target, the heads' mass on each entry, is summed over the ranks
        before it is normalised (`sum_heads`, which the caller sets), so every rank computes the single process's
        indexer loss and whole gradient, and the indexer's replicated parameters need no gradient sum."""
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
        sink = local_part(self.sinks).to(logits.dtype).view(1, -1, 1, 1).expand(batch, -1, length, 1)
        # the sink takes its share of each softmax and contributes no value
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = (probs @ kv[:, None]).transpose(1, 2)  # (B, T, H, hd)
        # keys are the values, so a value's rotary slice carries its key's angle: turn it back by the query's
        out = rotate_tail(out, cos.unsqueeze(-2), -sin.unsqueeze(-2))
        return self.output(out.flatten(-2))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, keep: dict[str, Any] | None = None, *,
                chunk: SequenceChunk | None = None, real: torch.Tensor | None = None,
                runs: Runs | None = None) -> torch.Tensor:
        """positions: (T,) the tokens' positions in the sequence (0, 1, ...; under context parallel `chunk`'s
        pieces). keep: filled with the keys and the compressor's and indexer's projections and entries, for a
        generation cache to start from. real: (B, T) the queries the indexer loss counts (None: every one).
        runs: the whole sequence's runs of one document's real tokens (context parallel over packed or left-padded
        rows): each token rotates by its place in its run and reads only its run's keys and entries."""
        if keep is None:
            return self._blockwise(x, positions, chunk, real, runs)
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
                   real: torch.Tensor | None = None, runs: Runs | None = None) -> torch.Tensor:
        spans = _spans(x.shape[1], chunk)
        rot = positions if runs is None else runs.pos[:, positions]  # (B, n) with runs: places in their runs
        cos, sin = rotary_tables(rot, self.rope_dim, self.theta, self.scaling)
        latent, q, kv = self._project(x, cos, sin)
        kv = _whole(kv, chunk)  # the one key and value head, every rank's in sequence order
        windows = None if runs is None or self.compressor is None else runs.windows(self.compressor.rate)

        def entries_of(module: Compressor, inputs: torch.Tensor) -> torch.Tensor:
            if windows is None:
                return module.entries(inputs, spans, chunk)
            return module.run_entries(inputs, chunk, windows.rows, windows.starts, windows.index, windows.slots,
                                      windows.run.shape[1])

        entries = entries_of(self.compressor, x) if self.compressor is not None else None
        if self.sum_gradient is not None:  # tensor parallel: every rank's heads read the whole key/value head
            if entries is None:
                kv = self.sum_gradient(kv)
            else:
                joined = self.sum_gradient(torch.cat([kv, entries], dim=1))  # one all-reduce in backward
                kv, entries = joined[:, :kv.shape[1]], joined[:, kv.shape[1]:]
        picked, learn = None, None
        if self.indexer is not None and entries is not None and entries.shape[1]:
            if self.learns_index():
                # the indexer learns from its own loss only: its inputs leave the model's graph
                x_in, latent_in = x.detach(), latent.detach()
                learn = _IndexInputs(x_in, latent_in, entries_of(self.indexer, x_in), real)
                if chunk is not None and chunk.ulysses:
                    learn = _ulysses_inputs(learn, chunk, self.sum_heads)
            if not self.dense:
                with torch.no_grad():  # top-k passes no gradient: its own scores are kept for no backward
                    keys = learn.keys.detach() if learn is not None else entries_of(self.indexer, x)
                    if runs is None or windows is None:
                        picked = self.indexer.chosen(x, latent, positions, keys)
                    else:
                        picked = self.indexer.run_chosen(x, latent, rot, runs.run[:, positions], keys,
                                                         windows.counts, windows.first)
        # Ulysses: the queries run over the whole sequence, so the indexer reads every token's place in its run
        doc = None if runs is None else _RunView(runs, windows, runs.pos if chunk is not None and chunk.ulysses
                                                 else rot)
        heads = None
        if chunk is not None and chunk.ulysses:  # this rank's heads over the whole sequence, as one piece
            q = chunk.to_heads(q)
            heads = slice(chunk.index * q.shape[1], (chunk.index + 1) * q.shape[1])
            spans = [(0, q.shape[2], 0)]
            if picked is not None:  # every query's picks (they are the same for every head)
                both = _whole(torch.cat([picked[0], picked[1].long()], dim=-1), chunk)
                picked = both[..., :picked[0].shape[-1]], both[..., picked[0].shape[-1]:].bool()
        blocks = [self._attend_block(q[:, :, start:start + n], kv, entries, picked, s, start, n, at, learn, doc,
                                     heads)
                  for s, length, at in spans
                  for start, n in self._blocks(s, length)]
        out = torch.cat([o for o, _ in blocks], dim=2)
        if chunk is not None and chunk.ulysses:
            out = chunk.to_sequence(out)  # back to this rank's pieces of every head
        out = out.transpose(1, 2)  # (B, T, H, hd)
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
                      learn: _IndexInputs | None = None, doc: _RunView | None = None, heads: slice | None = None
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The outputs (B, H, n, hd) of queries q (B, H, n, hd) at sequence positions at + (start - span_start)
        onward, against the whole sequence's keys kv (B, T, hd) and entries (B, W, hd); with `learn`, the indexer
        loss of the block's queries (summed KL, counted queries). doc: the batch's runs (each query reads its own
        run's keys and entries only; entries are slots of its row's, `Windows`). heads: which of the module's heads
        q holds (Ulysses: their sinks)."""
        first = at + start - span_start
        pos = torch.arange(first, first + n, device=q.device)
        low = max(0, first - self.window + 1)
        keys = kv[:, low:first + n]  # every key of the block's windows
        distance = pos[:, None] - torch.arange(low, first + n, device=q.device)
        masks = [(distance >= 0) & (distance < self.window)]
        run_q = None
        if doc is not None:  # within one run the window over sequence places is the window over run positions
            run_q = doc.runs.run[:, first:first + n]
            same = (run_q[:, :, None] == doc.runs.run[:, None, low:first + n]) & (run_q >= 0)[:, :, None]
            masks[0] = (masks[0] & same)[:, None]
        scale = self.head_dim**-0.5
        logits = [(q @ keys[:, None].transpose(-1, -2)) * scale]
        seen: torch.Tensor | None = None
        if entries is not None and self.compressor is not None:
            windows = None if doc is None else doc.windows
            if picked is None and (windows is None or run_q is None):
                # HCA: every entry the block's last query may see
                seen = entries[:, :(first + n) // self.compressor.rate]
                masks.append(self.compressor.visible(pos, seen.shape[1]))
                logits.append((q @ seen[:, None].transpose(-1, -2)) * scale)
            elif picked is None:  # HCA over runs: the slots ending by the block's last query, of each query's run
                assert windows is not None and run_q is not None
                ends, run_e = windows.ends, windows.run
                count = int((ends <= first + n - 1).sum(1).max())  # each row's slots are in sequence order
                seen = entries[:, :count]
                masks.append(((run_e[:, None, :count] == run_q[:, :, None])
                              & (ends[:, None, :count] <= pos[None, :, None]))[:, None])
                logits.append((q @ seen[:, None].transpose(-1, -2)) * scale)
            else:  # CSA: each query's picks, gathered (B, n, k, hd)
                chosen, kept = picked[0][:, start:start + n], picked[1][:, start:start + n]
                seen = entries[torch.arange(entries.shape[0], device=q.device)[:, None, None], chosen]
                masks.append(kept[:, None])
                logits.append(torch.einsum("bhqd,bqkd->bhqk", q, seen) * scale)
        scores = torch.cat([lg.masked_fill(~m, float("-inf")) for lg, m in zip(logits, masks, strict=True)]
                           + [local_part(self.sinks)[heads or slice(None)].to(q.dtype).view(1, -1, 1, 1).expand(
                               q.shape[0], -1, n, 1)],
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
        scores = self.indexer.score(learn.x[:, rows], learn.latent[:, rows], pos if doc is None else doc.rot[:, rows],
                                    keys_in)
        real = None if learn.real is None else learn.real[:, rows]
        allowed = (masks[-1] if doc is None else masks[-1][:, 0]).expand_as(scores) if picked is None else \
            picked[1][:, rows]
        return out, index_kl(tail.detach(), scores, allowed, real, learn.sum_heads or self.sum_heads)


@dataclass
class _RunView:
    """What a query block reads of the batch's runs: the runs, the compressor's windows (None: no compressor) and
    this rank's tokens' positions in their runs (B, n)."""

    runs: Runs
    windows: Windows | None
    rot: torch.Tensor


@dataclass
class _IndexInputs:
    """What the indexer loss reads of a forward (detached from the model): the inputs x (B, T, D), the query latent
    (B, T, q_rank), the indexer's keys of every entry (B, W, index_dim, with grad) and the counted queries (B, T)."""

    x: torch.Tensor
    latent: torch.Tensor
    keys: torch.Tensor
    real: torch.Tensor | None
    # Ulysses: the heads' mass summed over the tensor- and context-parallel ranks (None: the module's `sum_heads`)
    sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None


def _ulysses_inputs(learn: _IndexInputs, chunk: SequenceChunk,
                    sum_heads: Callable[[torch.Tensor], torch.Tensor] | None) -> _IndexInputs:
    """The indexer loss's inputs under Ulysses, where this rank's heads attend over the whole sequence: the whole
    sequence's x and latent (detached, every rank's pieces), the target's mass summed over the cp ranks' heads (after
    tensor parallel's `sum_heads`), and only this rank's own (real) queries counted, so that the cp ranks' losses and
    indexer gradients add up to one process's, as under the all-gather method."""
    exchange = chunk.exchange
    assert exchange is not None
    local = learn.x.shape[1]
    own = torch.zeros(learn.x.shape[0], local * chunk.count, dtype=torch.bool, device=learn.x.device)
    own[:, chunk.positions(local, learn.x.device)] = True if learn.real is None else learn.real.to(own.device).bool()

    def summed(mass: torch.Tensor) -> torch.Tensor:
        if sum_heads is not None:
            mass = sum_heads(mass)
        # every rank sends its mass to every rank: an all-gather through the all-to-all, then summed in rank order
        return exchange(mass.detach().expand(chunk.count, *mass.shape).contiguous()).sum(0)

    return _IndexInputs(_whole(learn.x, chunk), _whole(learn.latent, chunk), learn.keys, own, summed)


def index_kl(probs: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor, real: torch.Tensor | None = None,
             sum_heads: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed KL, counted queries) of the CSA indexer loss over one block of queries. probs (B, H, n, E): the main
    attention's probabilities on the E entries the queries read (no gradient); scores (B, n, E): the indexer's;
    allowed (B, n, E): the entries each query reads. Per query the target p is the heads' summed mass on its entries
    normalised over them, and its loss KL(p || softmax of the scores over the same entries). A query is counted when
    it reads an entry (and is real: `real` (B, n)). sum_heads: the sum over the ranks of what each rank's heads hold
    (`probs` has this rank's heads only: tensor parallel's, and under Ulysses the cp ranks' too)."""
    mass = probs.float().sum(dim=1).masked_fill(~allowed, 0.0)  # (B, n, E)
    if sum_heads is not None:  # every head's mass before normalising: the same target on every rank
        mass = sum_heads(mass)
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


class V4Attention(CompressedAttention):
    """`CompressedAttention` called as a block's token mixer (`module(x, mask, rope=..., cache=..., ...)`): it
    rotates with its own tables from the tokens' positions, 0, 1, ... from each row's first real token and from
    each packed document's start. A left-padded or packed row is read as its runs of real tokens of one document,
    each computed as if alone (its compression windows start with it), under context parallel too (`Runs`: the
    runs read from the whole sequence's padding and documents); right padding is read in place (a causal query
    never reads the pads after it)."""

    def forward(self, x: torch.Tensor, mask: Any = None, *, rope: Any = None, bias: Any = None,  # type: ignore[override]
                cache: V4Cache | None = None, chunk: Any = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """padding: (B, T) of x's tokens (under context parallel this rank's pieces'); documents: (B, T) of the
        whole sequence."""
        # right padding is read in place: its pads are queries the indexer loss does not count
        real = padding if padding is not None and padding.shape[:2] == x.shape[:2] else None
        if chunk is not None and padding is not None:  # every rank decides on, and reads runs from, the whole rows
            padding = _whole(padding[..., None].long(), chunk)[..., 0].bool()
        if padding is not None and bool((padding[:, 1:] & ~padding[:, :-1]).sum(1).gt(1 - padding[:, 0].long()).any()):
            raise ConfigError("DeepSeek-V4 attention blocks read pads at a row's start or end, but a row has pads "
                              "between its tokens", "pad rows on the left or the right only")
        packed = documents is not None and bool((documents != documents[:, :1]).any())
        right_padded = padding is None or bool((padding == padding.cummin(dim=1).values).all())
        self.start_forward()
        if chunk is not None:
            places = chunk.positions(x.shape[1], x.device)
            if packed or not right_padded:  # this rank's pieces hold parts of runs that start elsewhere
                return super().forward(x, places, chunk=chunk, runs=Runs(padding, documents))
            return super().forward(x, places, chunk=chunk, real=real)
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
            rows, firsts, lengths = segments(padding, documents)
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
