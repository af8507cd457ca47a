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
decoding step runs the recurrence. Its kind, `mamba2`, is declared in model/components/mamba2.py.

Its per-head parameters A_log, D and dt_bias and the convolution's taps and bias are vectors or (C, 1, W) filters, not
matrices: Muon (train/muon.py: `is_muon_parameter`) leaves them to AdamW, as it does norms, and none of them decays
but the taps. in_proj and out_proj are matrices and go to Muon.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.config import ModelConfig
from meshformer.model.gated_delta import causal_conv1d
from meshformer.model.linear_attention import LinearCache
from meshformer.model.ssd import chunk_ssd, recurrent_ssd


class GroupedGatedRMSNorm(nn.Module):
    """norm(x * silu(z)) * weight, the RMS taken over each of `groups` equal slices of the channels (gate first, as
    Mamba-2 with norm_before_gate=False; Gated DeltaNet's norm gates after)."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, compute = x.dtype, torch.promote_types(x.dtype, torch.float32)  # half in float32, float64 stays
        gated = x.to(compute) * F.silu(gate.to(compute))
        grouped = gated.view(*gated.shape[:-1], self.groups, -1)
        normed = F.rms_norm(grouped, (grouped.shape[-1],), eps=self.eps).view_as(gated)
        return self.weight * normed.to(dtype)


class Mamba2(nn.Module):
    """The Mamba-2 token mixer; widths from `[model.mamba]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mamba
        self.n_heads, self.head_dim, self.state_size, self.n_groups = m.n_heads, m.head_dim, m.state_size, m.n_groups
        self.chunk_size, self.dt_floor = m.chunk_size, m.dt_floor
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

    def forward(self, x: torch.Tensor, mask: object = None, *, rope: object = None, bias: object = None,
                cache: LinearCache | None = None, chunk: object = None, padding: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, D) -> (B, T, D), called as Gated DeltaNet is (model/linear_attention.py): padding (B, T, True
        for real tokens) and documents (B, T) of this call's tokens; mask, rope and bias are not read."""
        if chunk is not None:
            raise ValueError("mamba2 blocks run on one context-parallel rank; set parallel.cp=1")
        keep = None if padding is None else padding[..., None].to(x.dtype)
        if keep is not None:
            x = x * keep
        batch, length, _ = x.shape
        inner, groups_width = self.n_heads * self.head_dim, self.n_groups * self.state_size
        z, xbc, dt = self.in_proj(x).split([inner, self.conv_channels, self.n_heads], dim=-1)
        xbc, conv_state = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                        state=None if cache is None else cache.conv, doc_ids=documents)
        xbc = F.silu(xbc)
        if keep is not None:
            xbc = xbc * keep
        xs, B, C = xbc.split([inner, groups_width, groups_width], dim=-1)
        xs = xs.reshape(batch, length, self.n_heads, self.head_dim)
        B = B.reshape(batch, length, self.n_groups, self.state_size)
        C = C.reshape(batch, length, self.n_groups, self.state_size)
        compute = torch.promote_types(x.dtype, torch.float32)
        dt = F.softplus(dt.to(compute) + self.dt_bias.to(compute)).clamp(min=self.dt_floor)
        A = -self.A_log.to(compute).exp()
        state = None if cache is None else cache.state
        if state is not None and length == 1:  # one decoding step: the recurrence is the cheaper form
            y, final = recurrent_ssd(xs, dt, A, B, C, initial_state=state, doc_ids=documents)
        else:
            y, final = chunk_ssd(xs, dt, A, B, C, chunk_size=self.chunk_size, initial_state=state, doc_ids=documents)
        if cache is not None:
            cache.conv, cache.state, cache.length = conv_state, final, cache.length + length
        y = y + xs * self.D.to(xs.dtype)[:, None]
        return self.out_proj(self.norm(y.reshape(batch, length, inner), z))
