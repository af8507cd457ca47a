"""Mamba-2, the token mixer of the "mamba2" blocks (transformers' NemotronH `Mamba2Mixer`, mamba-ssm's `Mamba2`).

Per token one projection (`in_proj`, no bias) gives, in the checkpoints' order, the gate z (H x P), the scan's
input x (H x P), its input and output maps B and C (G x N each) and the step size dt (one per head). x, B and C pass
a short causal depthwise convolution (`conv1d`, with a bias by default) and SiLU. dt = max(softplus(dt + dt_bias),
model.mamba.dt_floor), and each head runs the state-space scan (model/ssd.py) with decay rate A = -exp(A_log), then
adds the skip D * x. Its output is multiplied by silu(z), RMS-normalised over each group's channels, scaled by
`norm.weight` and projected back (`out_proj`, no bias).

Padding tokens enter as zeros and leave the convolution as zeros (its bias would otherwise write them), so
left-padded prompts start from an empty state. With packed documents (doc_ids) the state and the convolution
window restart at every document. Generation carries both in a `LinearCache` (model/linear_attention.py); one
decoding step runs the recurrence. Context parallel passes the convolution window and the state from piece to
piece (Ulysses instead moves x, B, C and dt to whole sequences of a run of heads and groups: `_to_heads`), and tensor
parallel splits it by heads (`shard_heads`), as Gated DeltaNet does. Its kind, `mamba2`, is
declared in model/components/mamba2.py.

Its per-head parameters A_log, D and dt_bias and the convolution's taps and bias are vectors or (C, 1, W) filters, not
matrices: Muon (optim/muon.py: `is_muon_parameter`) leaves them to AdamW, as it does norms, and none of them decays
but the taps. in_proj and out_proj are matrices and go to Muon.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.attention import SequenceChunk
from meshformer.model.config import ModelConfig
from meshformer.model.gated_delta import causal_conv1d
from meshformer.model.linear_attention import HeadShard, LinearCache, PieceExchange, _part
from meshformer.model.mamba2_kernels import kernel_conv1d, kernel_scan, mamba_importable
from meshformer.model.sharded import local_part
from meshformer.model.ssd import chunk_ssd, recurrent_ssd


class GroupedGatedRMSNorm(nn.Module):
    """norm(x * silu(z)) * weight, the RMS taken over each of `groups` equal slices of the channels (gate first, as
    Mamba-2 with norm_before_gate=False; Gated DeltaNet's norm gates after)."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: the scale to use in place of `self.weight` (a tensor-parallel rank's part of it)."""
        dtype, compute = x.dtype, torch.promote_types(x.dtype, torch.float32)  # half in float32, float64 stays
        gated = x.to(compute) * F.silu(gate.to(compute))
        grouped = gated.view(*gated.shape[:-1], self.groups, -1)
        normed = F.rms_norm(grouped, (grouped.shape[-1],), eps=self.eps).view_as(gated)
        return (self.weight if weight is None else weight) * normed.to(dtype)


class Mamba2(nn.Module):
    """The Mamba-2 token mixer; widths from `[model.mamba]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mamba
        self.n_heads, self.head_dim, self.state_size, self.n_groups = m.n_heads, m.head_dim, m.state_size, m.n_groups
        self.chunk_size, self.dt_floor, self.backend = m.chunk_size, m.dt_floor, m.backend
        inner = m.n_heads * m.head_dim
        self.conv_channels = inner + 2 * m.n_groups * m.state_size  # x, B and C pass the convolution
        self.in_proj = nn.Linear(cfg.d_model, inner + self.conv_channels + m.n_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, m.conv_width, groups=self.conv_channels,
                                bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.n_heads))
        self.A_log = nn.Parameter(torch.zeros(m.n_heads))
        self.D = nn.Parameter(torch.ones(m.n_heads))
        self.norm = GroupedGatedRMSNorm(inner, m.n_groups, cfg.norm.eps)
        self.out_proj = nn.Linear(inner, cfg.d_model, bias=False)
        self.head_shard: HeadShard | None = None  # tensor parallel: this rank's in_proj rows (`shard_heads`)
        self.conv_rows: torch.Tensor | None = None  # ... and its convolution channels

    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
        """Run rank `rank`'s heads of `ranks` (and the groups of B and C they read) from now on. A_log, D, dt_bias
        and the norm's weight are head-major and split on dim 0; in_proj's rows ([z | x | B | C | dt]) and the
        convolution's channels ([x | B | C]) are not, so every rank keeps them whole and reads its own, their
        gradients summed over the ranks."""
        inner, groups_width = self.n_heads * self.head_dim, self.n_groups * self.state_size
        heads = torch.arange(self.n_heads).view(ranks, -1)[rank]
        xs = torch.arange(inner).view(ranks, -1)[rank]
        groups = torch.arange(groups_width).view(ranks, -1)[rank]
        conv = torch.cat([xs, inner + groups, inner + groups_width + groups])
        self.head_shard = HeadShard(torch.cat([xs, inner + conv, inner + self.conv_channels + heads]), sum_gradient)
        self.conv_rows = conv
        self.n_heads, self.n_groups = self.n_heads // ranks, self.n_groups // ranks
        self.conv_channels, self.norm.groups = len(conv), self.n_groups
        whole = ["in_proj.weight", "conv1d.weight"] + (["conv1d.bias"] if self.conv1d.bias is not None else [])
        return ["A_log", "D", "dt_bias", "norm.weight"], whole

    def _rows(self, weight: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """This rank's rows of a weight every rank holds whole (its gradient summed over the ranks); all of them
        without tensor parallel."""
        if self.head_shard is None or rows is None:
            return weight
        return self.head_shard.sum_gradient(local_part(weight))[rows.to(weight.device)]

    def forward(self, x: torch.Tensor, mask: object = None, *, rope: object = None, bias: object = None,
                cache: LinearCache | None = None, chunk: object = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D), called as Gated DeltaNet is (model/linear_attention.py): padding (B, T, True
        for real tokens) and documents (B, T) of this call's tokens; mask, rope and bias are not read."""
        keep = None if padding is None else padding[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        batch, length, _ = x.shape
        inner = self.n_heads * self.head_dim
        if self.head_shard is None:
            projected = self.in_proj(x)
        else:  # x's gradient from this rank's rows alone: summed over the ranks, as a colwise linear's is
            projected = F.linear(self.head_shard.sum_gradient(x), self._rows(self.in_proj.weight,
                                                                             self.head_shard.channels))
        z, xbc, dt = projected.split([inner, self.conv_channels, self.n_heads], dim=-1)
        weight = self._rows(self.conv1d.weight, self.conv_rows).squeeze(1)
        conv_bias = None if self.conv1d.bias is None else self._rows(self.conv1d.bias, self.conv_rows)
        part = None
        if isinstance(chunk, SequenceChunk):
            if cache is not None:
                raise ValueError("mamba2 blocks generate on one device; set parallel.cp=1 to generate")
            if not chunk.ulysses:
                y, xs = self._forward_pieces(xbc, dt, weight, conv_bias, keep, chunk, documents)
                y = y + xs * local_part(self.D).to(xs.dtype)[:, None]
                return self.out_proj(self.norm(y.reshape(batch, length, inner), z, local_part(self.norm.weight)))
            xbc, dt, keep, weight, conv_bias = self._to_heads(xbc, dt, keep, weight, conv_bias, chunk)
            part = (chunk.index, chunk.count)
        y = self._mix(xbc, dt, weight, conv_bias, keep, cache, documents, part)
        if part is not None:  # back to this rank's pieces of every head, for the gate z that never moved
            assert isinstance(chunk, SequenceChunk)
            y = chunk.to_sequence(y.transpose(1, 2)).transpose(1, 2)
        return self.out_proj(self.norm(y.reshape(batch, length, inner), z, local_part(self.norm.weight)))

    def _mix(self, xbc: torch.Tensor, dt: torch.Tensor, weight: torch.Tensor, conv_bias: torch.Tensor | None,
             keep: torch.Tensor | None, cache: LinearCache | None, documents: torch.Tensor | None,
             part: tuple[int, int] | None) -> torch.Tensor:
        """The convolution, the scan and its skip over whole sequences: y (B, T, H, P) from the convolution's input
        (B, T, channels) and dt's projection (B, T, H). part: (index, count) under Ulysses, the index-th of count
        equal runs of this module's heads (and groups), whose channels xbc, dt, weight and conv_bias already are."""
        length = xbc.shape[1]
        D = _part(self.D, part)
        if cache is None and (self.backend == "mamba_ssm" or (self.backend == "auto" and xbc.is_cuda
                                                             and mamba_importable())):
            # the kernels: SiLU fused into the convolution, dt's softplus and the skip D into the scan
            xs, B, C = self._split_xbc(kernel_conv1d(xbc, weight, conv_bias, doc_ids=documents), keep, dt.shape[-1])
            A = -_part(self.A_log, part).to(torch.promote_types(xs.dtype, torch.float32)).exp()
            y, _ = kernel_scan(xs, dt, A, B, C, chunk_size=self.chunk_size, D=D, dt_bias=_part(self.dt_bias, part),
                               dt_floor=self.dt_floor, doc_ids=documents)
            return y
        xbc, conv_state = causal_conv1d(xbc, weight, conv_bias, state=None if cache is None else cache.conv,
                                        doc_ids=documents)
        xs, dt, A, B, C = self._scan_inputs(xbc, dt, keep, part)
        state = None if cache is None else cache.state
        if state is not None and length == 1:  # one decoding step: the recurrence is the cheaper form
            y, final = recurrent_ssd(xs, dt, A, B, C, initial_state=state, doc_ids=documents)
        else:
            y, final = chunk_ssd(xs, dt, A, B, C, chunk_size=self.chunk_size, initial_state=state, doc_ids=documents)
        if cache is not None:
            cache.conv, cache.state, cache.length = conv_state, final, cache.length + length
        return y + xs * D.to(xs.dtype)[:, None]

    def _to_heads(self, xbc: torch.Tensor, dt: torch.Tensor, keep: torch.Tensor | None, weight: torch.Tensor,
                  conv_bias: torch.Tensor | None, chunk: SequenceChunk
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """Ulysses context parallel: x, B, C, dt and the padding go all-to-all from this rank's pieces of every head
        (and group) to whole sequences of its 1/count of them (`SequenceChunk.to_heads`; rank r: the r-th run of
        heads and the r-th run of groups, which those heads read), and the convolution's taps and bias are cut to
        those channels; the convolution and the scan then run as on one device, no state crossing ranks."""
        batch, length, _ = xbc.shape
        heads, groups, count = dt.shape[-1], self.n_groups, chunk.count
        inner, groups_width = heads * self.head_dim, groups * self.state_size

        def whole(t: torch.Tensor, n: int) -> torch.Tensor:
            """(B, T/count, n, w) -> (B, T, n/count, w): this rank's heads (or groups) over the whole sequence."""
            return chunk.to_heads(t.transpose(1, 2).contiguous()).transpose(1, 2)

        xs, B, C = xbc.split([inner, groups_width, groups_width], dim=-1)
        xs = whole(xs.reshape(batch, length, heads, self.head_dim), heads).flatten(2)
        bc = torch.cat([B.reshape(batch, length, groups, -1), C.reshape(batch, length, groups, -1)], dim=-1)
        B, C = whole(bc, groups).split([self.state_size, self.state_size], dim=-1)
        # the padding travels with dt, one copy per head, so each rank gets the whole sequence's
        mask = torch.ones_like(dt) if keep is None else keep.expand_as(dt)
        dt, mask = whole(torch.stack([dt, mask], dim=-1), heads).unbind(-1)
        xbc = torch.cat([xs, B.flatten(2), C.flatten(2)], dim=-1)
        mine = torch.arange(inner).view(count, -1)[chunk.index]
        picked = torch.arange(groups_width).view(count, -1)[chunk.index]
        channels = torch.cat([mine, inner + picked, inner + groups_width + picked]).to(weight.device)
        return (xbc, dt, None if keep is None else mask[..., :1], weight[channels],
                None if conv_bias is None else conv_bias[channels])

    def _scan_inputs(self, xbc: torch.Tensor, dt: torch.Tensor, keep: torch.Tensor | None,
                     part: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """x (B, T, H, P), dt (B, T, H), A (H,), B and C (B, T, G, N) from the convolution's output (B, T, channels)
        and dt's projection; padding tokens' x, B and C zeroed. part: as `_mix`'s."""
        xs, B, C = self._split_xbc(F.silu(xbc), keep, dt.shape[-1])
        compute = torch.promote_types(xbc.dtype, torch.float32)
        dt = F.softplus(dt.to(compute) + _part(self.dt_bias, part).to(compute)).clamp(min=self.dt_floor)
        return xs, dt, -_part(self.A_log, part).to(compute).exp(), B, C

    def _split_xbc(self, xbc: torch.Tensor, keep: torch.Tensor | None, heads: int) -> tuple[torch.Tensor, ...]:
        """x (B, T, heads, P), B and C (B, T, G, N) from the activated convolution output, padding tokens zeroed
        (heads: this module's, or under Ulysses this rank's share of them and of the groups)."""
        batch, length, _ = xbc.shape
        if keep is not None:
            xbc = xbc * keep
        groups = self.n_groups * heads // self.n_heads
        inner, groups_width = heads * self.head_dim, groups * self.state_size
        xs, B, C = xbc.split([inner, groups_width, groups_width], dim=-1)
        return (xs.reshape(batch, length, heads, self.head_dim),
                B.reshape(batch, length, groups, self.state_size),
                C.reshape(batch, length, groups, self.state_size))

    def _forward_pieces(self, xbc: torch.Tensor, dt: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        keep: torch.Tensor | None, chunk: SequenceChunk, documents: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallel (`PieceExchange`, as Gated DeltaNet's): this rank's two pieces of each sequence run in
        sequence order across the ranks, the convolution's window and the (B, H, P, N) state passing from piece to
        piece. Returns the scan's output (B, T, H, P) without the skip, and x (B, T, H, P)."""
        batch, length, _ = xbc.shape
        exchange = PieceExchange(chunk, length, documents)
        xs, dt, A, B, C = self._scan_inputs(exchange.convolve(xbc, weight, bias), dt, keep)

        def run(rows: slice, entering: torch.Tensor | None, docs: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
            return chunk_ssd(xs[:, rows], dt[:, rows], A, B[:, rows], C[:, rows], chunk_size=self.chunk_size,
                             initial_state=entering, doc_ids=docs)

        merged = exchange.pass_states(run, (batch, self.n_heads, self.head_dim, self.state_size), dt)
        return merged, xs
