"""Gated DeltaNet, the token mixer of the "linear_attention" blocks (Qwen3-Next's `linear_attn`).

Per token: one projection gives, for each query/key head, its query, key, the values of the value heads it serves and as
many output gates z (`in_proj_qkvz`, grouped by key head as the checkpoints store it); another gives each value head's
write strength b and decay input a (`in_proj_ba`, grouped likewise); linear_attention.projections = "split" holds the
same rows as in_proj_qkv (every q, then k, then v), in_proj_z, in_proj_b and in_proj_a (Qwen3.5's layout), "separate" as
in_proj_q, in_proj_k, in_proj_v, in_proj_z, in_proj_b and in_proj_a with the taps apart too (q_conv1d, k_conv1d,
v_conv1d: OLMo hybrid's). q, k and v pass a short causal depthwise convolution (`conv1d`, no bias) and SiLU; q and k are
L2-normalised inside the rule. Each value head then runs the gated delta rule (model/gated_delta.py) with beta =
sigmoid(b) (2 sigmoid(b) with linear_attention.allow_neg_eigval) and log decay g = -exp(A_log) * softplus(a + dt_bias)
(A_log and dt_bias as checkpoints store them). Its output is RMS-normalised per head (epsilon:
linear_attention.norm_eps, else model.norm.eps), scaled by `norm.weight` (a plain scale starting at 1, whatever
model.norm.weight_offset says) and gated by silu(z), then projected back (`out_proj`). No linear here has a bias.

Padding tokens enter as zeros (their keys and values write nothing), so left-padded prompts start from an empty
state. With packed documents (doc_ids) the recurrent state and the convolution window restart at every document.
Generation carries both in a `LinearCache`. Its kind, `linear_attention`, is declared in
model/components/linear_attention.py.

Tensor parallel splits it by key head (and the value heads each serves): `shard_heads` gives the module this
rank's share. The grouped projections and z, b, a are head-major, so they split as plain colwise linears, and
A_log / dt_bias by value head. The convolution's channels (and the split layout's in_proj_qkv rows) are ordered
[all q | all k | all v], which no contiguous split matches: those weights stay whole on every rank, each rank
convolves (projects) its own heads' channels and their gradients are summed over the ranks. So is the gated norm's
weight, which every head shares.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.attention import SequenceChunk
from meshformer.model.config import ModelConfig
from meshformer.model.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule
from meshformer.model.gated_delta_fla import fla_gated_delta_rule, fla_importable
from meshformer.model.sharded import local_part


@dataclass
class LinearCache:
    """What a linear_attention block carries between generation steps: the convolution's last inputs
    (B, conv_width - 1, channels), the recurrent state (B, H, Dk, Dv) and how many tokens it has seen."""

    conv: torch.Tensor | None = None
    state: torch.Tensor | None = None
    length: int = 0


@dataclass(frozen=True)
class HeadShard:
    """A tensor-parallel rank's heads of a GatedDeltaNet: `channels` indexes its heads' q, k and v among the
    [all q | all k | all v] channels; `sum_gradient` (identity forward) sums the gradient of a weight every rank
    holds whole over the ranks, each of which computed its heads' share."""

    channels: torch.Tensor
    sum_gradient: Callable[[torch.Tensor], torch.Tensor]


def head_channels(key_heads: int, key_head_dim: int, value_heads: int, value_head_dim: int, ranks: int,
                  rank: int) -> torch.Tensor:
    """Indices of rank `rank`'s heads' q, k and v channels (of `ranks`, each holding a contiguous run of key heads
    and the value heads they serve) among the [all q | all k | all v] channels."""
    key_dim = key_heads * key_head_dim
    keys = torch.arange(key_dim).view(ranks, -1)[rank]
    values = torch.arange(value_heads * value_head_dim).view(ranks, -1)[rank]
    return torch.cat([keys, key_dim + keys, 2 * key_dim + values])


def _part(t: torch.Tensor, part: tuple[int, int] | None) -> torch.Tensor:
    """This rank's part of a head-major parameter; under Ulysses (part: (index, count)) its index-th run of heads."""
    t = local_part(t)
    return t if part is None else t.view(part[1], -1)[part[0]]


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * activation(gate) over the last dimension (activation: SiLU, or KDA's sigmoid),
    normalised in float32."""

    def __init__(self, width: int, eps: float,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: the scale to use in place of `self.weight` (a tensor-parallel rank's view of it)."""
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        return ((self.weight if weight is None else weight) * normed * self.activation(gate.float())).to(dtype)

class PieceExchange:
    """Context parallel's exchange for a recurrent mixer (Gated DeltaNet, Mamba-2): this rank's two pieces of each
    sequence (`SequenceChunk`), run in sequence order across the ranks. `convolve`: the convolution's last W - 1
    inputs of every piece are all-gathered once, so each piece starts from its predecessor's. `pass_states`: after
    piece p's owner has run it, every rank all-gathers its slot (the owner's final state, the others' zeros) and keeps
    the owner's, which enters piece p + 1; 2 x cp - 1 gathers of one state, each waiting for the previous piece. The
    gathers are differentiable (their backward reduce-scatters), so the state's gradient flows back to the previous
    piece; every rank's slot depends on the state it last received, so every rank's autograd graph holds every
    gather and runs their backward collectives in the same order. documents: the whole sequence's; a state or
    window from before a document's first token is dropped."""

    def __init__(self, chunk: SequenceChunk, length: int, documents: torch.Tensor | None) -> None:
        self.chunk, self.documents = chunk, documents
        self.spans = chunk.spans(length)
        self.piece_len, self.pieces = self.spans[0][1], 2 * chunk.count
        self.owner = [p if p < chunk.count else self.pieces - 1 - p for p in range(self.pieces)]  # each piece's rank
        self.local = {at // self.piece_len: start for start, _, at in self.spans}  # piece -> start in this rank's

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's (B, 2, *S) tensor (its early and late piece's) all-gathered: (B, 2, count, prod(S))."""
        return self.chunk.gather(t.flatten(2)[:, :, None].contiguous())

    def of_piece(self, slots: torch.Tensor, piece: int, shape: torch.Size) -> torch.Tensor:
        """Piece's (B, *S) of gathered slots."""
        return slots[:, 0 if piece < self.chunk.count else 1, self.owner[piece]].view(shape[:1] + shape[2:])

    def convolve(self, mixed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The causal convolution of this rank's tokens (B, T, C), each piece after the inputs before it."""
        width, documents = weight.shape[1], self.documents
        tail = min(width - 1, self.piece_len)  # a piece shorter than the window lends all its inputs
        tails = torch.stack([mixed[:, start + n - tail: start + n] for start, n, _ in self.spans], dim=1)
        all_tails = self.gather(tails)  # one gather for every rank: each takes the tails it needs
        conv_out = []
        for start, n, at in self.spans:
            piece = at // self.piece_len
            docs = None if documents is None else documents[:, at: at + n]
            prefix = None
            if piece > 0:
                earlier = torch.cat([self.of_piece(all_tails, p, tails.shape) for p in range(piece)], dim=1)
                prefix = earlier[:, -(width - 1):]  # the window's inputs before the piece, in sequence order
                if documents is not None:  # only those of the piece's first document
                    same = documents[:, at - prefix.shape[1]: at] == documents[:, at: at + 1]
                    prefix = prefix * same[..., None].to(prefix.dtype)
                prefix = F.pad(prefix, (0, 0, width - 1 - prefix.shape[1], 0))  # the sequence's start: zeros
            conv_out.append(causal_conv1d(mixed[:, start: start + n], weight, bias, state=prefix, doc_ids=docs)[0])
        return torch.cat(conv_out, dim=1)

    def pass_states(self, run: Callable[[slice, torch.Tensor | None, torch.Tensor | None],
                                        tuple[torch.Tensor, torch.Tensor]],
                    state_shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """`run(rows, entering state, documents)` -> (output, final state) of each of this rank's pieces, in sequence
        order with the state passed between ranks; this rank's outputs in its token order. `like`: a tensor of the
        parameters' graph (the first gather's zeros depend on it)."""
        documents, piece_len = self.documents, self.piece_len
        out: dict[int, torch.Tensor] = {}
        state: torch.Tensor | None = None
        for piece in range(self.pieces):
            slot = like.new_zeros(()) if state is None else state * 0  # not this rank's piece: zeros, in the graph
            if piece in self.local:
                start, at = self.local[piece], piece * piece_len
                entering = state
                if entering is not None and documents is not None:  # dropped where the piece starts a document
                    entering = entering * (documents[:, at] == documents[:, at - 1])[:, None, None, None].to(
                        entering.dtype)
                docs = None if documents is None else documents[:, at: at + piece_len]
                out[piece], slot = run(slice(start, start + piece_len), entering, docs)
            if piece == self.pieces - 1:
                break
            if state is None and slot.dim() == 0:  # the first gather: zeros that still depend on the parameters
                slot = slot.expand(state_shape) + like.sum() * 0
            both = torch.stack([slot, slot], dim=1)  # an early and a late slot per rank, as the gather expects
            state = self.of_piece(self.gather(both), piece, both.shape)
        assert state is not None
        merged = torch.cat([out[at // piece_len] for _, _, at in self.spans], dim=1)
        return merged + (state.sum() * 0).to(merged.dtype)  # the last gather's backward runs on every rank



class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer; head counts and widths from `[model.linear_attention]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        la = cfg.linear_attention
        self.n_heads, self.n_key_heads = la.n_heads, la.key_heads
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.chunk_size = la.chunk_size
        self.backend = la.backend
        key_dim, value_dim = la.key_heads * la.key_head_dim, la.n_heads * la.value_head_dim
        channels = 2 * key_dim + value_dim  # q, k and v pass the convolution
        self.split_projections = la.projections == "split"
        self.separate_projections = la.projections == "separate"
        self.beta_scale = 2.0 if la.allow_neg_eigval else 1.0
        if self.separate_projections:  # each head-major: all split colwise under tensor parallel
            self.in_proj_q = nn.Linear(cfg.d_model, key_dim, bias=False)
            self.in_proj_k = nn.Linear(cfg.d_model, key_dim, bias=False)
            self.in_proj_v = nn.Linear(cfg.d_model, value_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.d_model, value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.d_model, la.n_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.d_model, la.n_heads, bias=False)
        elif self.split_projections:
            self.in_proj_qkv = nn.Linear(cfg.d_model, channels, bias=False)
            self.in_proj_z = nn.Linear(cfg.d_model, value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.d_model, la.n_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.d_model, la.n_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(cfg.d_model, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.d_model, 2 * la.n_heads, bias=False)
        if self.separate_projections:  # OLMo hybrid's checkpoints store the q, k and v taps apart
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                nn.Conv1d(width, width, la.conv_width, groups=width, bias=False)
                for width in (key_dim, key_dim, value_dim))
        else:
            self.conv1d = nn.Conv1d(channels, channels, la.conv_width, groups=channels, bias=False)  # its weight only
        self.dt_bias = nn.Parameter(torch.ones(la.n_heads))
        self.A_log = nn.Parameter(torch.zeros(la.n_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.norm.eps if la.norm_eps is None else la.norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.d_model, bias=False)
        self.head_shard: HeadShard | None = None  # tensor parallel: this rank's heads (`shard_heads`)

    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
        """Run rank `rank`'s key heads of `ranks` (and the value heads they serve) from now on. Returns the names
        of its own parameters that the caller splits on dim 0 with the value heads, and of those every rank keeps
        whole (their gradients pass `sum_gradient`); the linears are the caller's (`tp_rules`)."""
        channels = head_channels(self.n_key_heads, self.key_head_dim, self.n_heads, self.value_head_dim, ranks, rank)
        self.head_shard = HeadShard(channels, sum_gradient)
        convs = ([f"{p}_conv1d.weight" for p in "qkv"] if self.separate_projections else ["conv1d.weight"])
        whole = [*convs, "norm.weight"] + (["in_proj_qkv.weight"] if self.split_projections else [])
        return ["A_log", "dt_bias"], whole

    def _whole(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight every rank holds whole, as this module reads it (its gradient summed over the ranks)."""
        weight = local_part(weight)
        return weight if self.head_shard is None else self.head_shard.sum_gradient(weight)

    def _channels(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a [all q | all k | all v] weight this module's heads use."""
        weight = self._whole(weight)
        return weight if self.head_shard is None else weight[self.head_shard.channels.to(weight.device)]

    def _conv_weight(self) -> torch.Tensor:
        """The depthwise convolution's (channels, width) taps over this module's heads' [q | k | v] channels."""
        if self.separate_projections:
            taps = torch.cat([local_part(c.weight) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)])
            return self._channels(taps).squeeze(1)
        return self._channels(self.conv1d.weight).squeeze(1)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x (B, T, D): mixed q|k|v (B, T, channels), z (B, T, H, Dv), b and a (B, T, H)."""
        batch, length, _ = x.shape
        dk, dv = self.key_head_dim, self.value_head_dim
        if self.separate_projections:
            qkv = torch.cat([self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x)], dim=-1)
            return (qkv, self.in_proj_z(x).view(batch, length, -1, dv), self.in_proj_b(x), self.in_proj_a(x))
        if self.split_projections:
            if self.head_shard is None:
                qkv = self.in_proj_qkv(x)
            else:  # x's gradient from this rank's rows alone: summed over the ranks, as a colwise linear's is
                qkv = F.linear(self.head_shard.sum_gradient(x), self._channels(self.in_proj_qkv.weight))
            return (qkv, self.in_proj_z(x).view(batch, length, -1, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        per_key = self.n_heads // self.n_key_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(x)
        # head count from the width: a tensor-parallel rank's projection holds whole key-head groups
        key_heads = qkvz.shape[-1] // (2 * dk + 2 * per_key * dv)
        qkvz = qkvz.view(batch, length, key_heads, 2 * dk + 2 * per_key * dv)
        q, k, v, z = qkvz.split([dk, dk, per_key * dv, per_key * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(batch, length, key_heads, 2 * per_key).split([per_key, per_key], dim=-1)
        mixed = torch.cat([t.reshape(batch, length, -1) for t in (q, k, v)], dim=-1)
        return (mixed, z.reshape(batch, length, -1, dv), b.reshape(batch, length, -1),
                a.reshape(batch, length, -1))

    def forward(self, x: torch.Tensor, mask: object = None, *, rope: object = None, bias: object = None,
                cache: LinearCache | None = None, chunk: object = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D), called as every token mixer (model/components/base.py) plus this call's tokens'
        padding (B, T, True for real tokens) and documents (B, T: each token's packed document; the state and the
        convolution restart where it changes). The mask, rope and bias are not read: the recurrence is causal and
        positions enter through its order. cache: carried across calls."""
        if padding is not None:
            x = x * padding[..., None].to(x.dtype)
        batch, length, _ = x.shape
        mixed, z, b, a = self._split(x)
        weight = self._conv_weight()
        if isinstance(chunk, SequenceChunk):
            if cache is not None:
                raise ValueError("linear_attention blocks generate on one device; set parallel.cp=1 to generate")
            if chunk.ulysses:
                return self._forward_ulysses(mixed, z, b, a, weight, chunk, documents)
            return self._forward_pieces(mixed, z, b, a, weight, chunk, documents)
        mixed, conv_state = causal_conv1d(mixed, weight, state=None if cache is None else cache.conv,
                                          doc_ids=documents)
        q, k, v, g, beta = self._rule_inputs(mixed, z, b, a)
        state = None if cache is None else cache.state
        if state is not None and length == 1:  # one decoding step: the recurrence is the cheaper form
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                    doc_ids=documents, use_qk_l2norm=True)
        else:
            out, final = self._chunked(q, k, v, g, beta, initial_state=state, output_final_state=cache is not None,
                                       doc_ids=documents)
        if cache is not None:
            cache.conv, cache.state, cache.length = conv_state, final, cache.length + length
        out = self.norm(out, z, self._whole(self.norm.weight)).reshape(batch, length, -1)
        return self.out_proj(out)

    def _chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 initial_state: torch.Tensor | None, output_final_state: bool, doc_ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunked rule (q and k L2-normalised inside) on the configured backend."""
        use_fla = self.backend == "fla" or (self.backend == "auto" and q.is_cuda and fla_importable())
        if use_fla:
            return fla_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state, doc_ids=doc_ids, use_qk_l2norm=True)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=initial_state,
                                      output_final_state=output_final_state, doc_ids=doc_ids, use_qk_l2norm=True)

    def _rule_inputs(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     part: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """q, k (B, T, Hk, Dk), v (B, T, H, Dv), g and beta (B, T, H) from the convolution's output (B, T, channels).
        part: (index, count) under Ulysses, the index-th of count equal runs of this module's heads."""
        batch, length, _ = mixed.shape
        mixed = F.silu(mixed)
        key_width = mixed.shape[-1] - b.shape[-1] * self.value_head_dim  # q and k channels together
        q, k, v = mixed.split([key_width // 2, key_width // 2, mixed.shape[-1] - key_width], dim=-1)
        q = q.reshape(batch, length, -1, self.key_head_dim)
        k = k.reshape(batch, length, -1, self.key_head_dim)
        v = v.reshape(batch, length, -1, self.value_head_dim)
        g = -_part(self.A_log, part).float().exp() * F.softplus(a.float() + _part(self.dt_bias, part).float())
        beta = b.sigmoid()
        return q, k, v, g, beta * self.beta_scale if self.beta_scale != 1.0 else beta

    def _forward_ulysses(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         weight: torch.Tensor, chunk: SequenceChunk, documents: torch.Tensor | None) -> torch.Tensor:
        """Ulysses context parallel: the convolution's inputs, b and a go all-to-all from this rank's pieces of
        every head to whole sequences of 1/count of the heads (`SequenceChunk.to_heads`); the convolution and the
        rule then run as on one device, with no state crossing ranks, and their output comes back to this rank's
        pieces (`to_sequence`) for the gated norm, whose gate z never moves. documents: the whole sequence's."""
        batch, length, _ = mixed.shape
        heads = b.shape[-1]  # value heads of this (tensor-parallel) rank
        value_width = heads * self.value_head_dim
        key_width = (mixed.shape[-1] - value_width) // 2
        key_heads = key_width // self.key_head_dim

        def whole(t: torch.Tensor, n_heads: int) -> torch.Tensor:
            """(B, T/count, n_heads x w), head-major -> (B, T, n_heads/count x w) of this rank's heads."""
            t = chunk.to_heads(t.reshape(batch, length, n_heads, -1).transpose(1, 2))
            return t.transpose(1, 2).flatten(2)

        q, k, v = mixed.split([key_width, key_width, value_width], dim=-1)
        mixed = torch.cat([whole(q, key_heads), whole(k, key_heads), whole(v, heads)], dim=-1)
        channels = head_channels(key_heads, self.key_head_dim, heads, self.value_head_dim, chunk.count, chunk.index)
        mixed, _ = causal_conv1d(mixed, weight[channels.to(weight.device)], doc_ids=documents)
        part = (chunk.index, chunk.count)
        q, k, v, g, beta = self._rule_inputs(mixed, z, whole(b, heads), whole(a, heads), part)
        out, _ = self._chunked(q, k, v, g, beta, initial_state=None, output_final_state=False, doc_ids=documents)
        out = chunk.to_sequence(out.transpose(1, 2)).transpose(1, 2)  # (B, T/count, H, Dv)
        out = self.norm(out, z, self._whole(self.norm.weight)).reshape(batch, length, -1)
        return self.out_proj(out)

    def _forward_pieces(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                        weight: torch.Tensor, chunk: SequenceChunk, documents: torch.Tensor | None) -> torch.Tensor:
        """Context parallel (`PieceExchange`): this rank's two pieces of each sequence run in sequence order across
        the ranks, the convolution's window and the (B, H, Dk, Dv) state passing from piece to piece."""
        batch, length, _ = mixed.shape
        exchange = PieceExchange(chunk, length, documents)
        q, k, v, g, beta = self._rule_inputs(exchange.convolve(mixed, weight, None), z, b, a)

        def run(rows: slice, entering: torch.Tensor | None, docs: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
            out, final = self._chunked(q[:, rows], k[:, rows], v[:, rows], g[:, rows], beta[:, rows],
                                       initial_state=entering, output_final_state=True, doc_ids=docs)
            assert final is not None
            return out, final

        merged = exchange.pass_states(run, (batch, v.shape[2], self.key_head_dim, self.value_head_dim), g)
        merged = self.norm(merged, z, self._whole(self.norm.weight)).reshape(batch, length, -1)
        return self.out_proj(merged)
