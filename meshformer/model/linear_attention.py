"""Gated DeltaNet, the token mixer of the "linear_attention" blocks (Qwen3-Next's `linear_attn`).

Per token: one projection gives, for each query/key head, its query, key, the values of the value heads it serves
and as many output gates z (`in_proj_qkvz`, grouped by key head as the checkpoints store it); another gives each
value head's write strength b and decay input a (`in_proj_ba`, grouped likewise); linear_attention.projections =
"split" holds the same rows as in_proj_qkv (every q, then k, then v), in_proj_z, in_proj_b and in_proj_a (Qwen3.5's
layout). q, k and v pass a short causal depthwise convolution (`conv1d`, no bias) and SiLU; q and k are
L2-normalised inside the rule. Each value head then runs the gated delta rule (model/gated_delta.py) with beta =
sigmoid(b) and log decay g = -exp(A_log) * softplus(a + dt_bias) (A_log and dt_bias as checkpoints store them). Its
output is RMS-normalised per head, scaled by `norm.weight` (a plain scale starting at 1, whatever
model.norm.weight_offset says) and gated by silu(z), then projected back (`out_proj`). No linear here has a bias.

Padding tokens enter as zeros (their keys and values write nothing), so left-padded prompts start from an empty
state. With packed documents (doc_ids) the recurrent state and the convolution window restart at every document.
Generation carries both in a `LinearCache`. Its kind, `linear_attention`, is declared in
model/components/linear_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.config import ModelConfig
from meshformer.model.gated_delta import causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule


@dataclass
class LinearCache:
    """What a linear_attention block carries between generation steps: the convolution's last inputs
    (B, conv_width - 1, channels), the recurrent state (B, H, Dk, Dv) and how many tokens it has seen."""

    conv: torch.Tensor | None = None
    state: torch.Tensor | None = None
    length: int = 0


class GatedRMSNorm(nn.Module):
    """weight * rmsnorm(x) * silu(gate) over the last dimension, normalised in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer; head counts and widths from `[model.linear_attention]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        la = cfg.linear_attention
        self.n_heads, self.n_key_heads = la.n_heads, la.key_heads
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.chunk_size = la.chunk_size
        key_dim, value_dim = la.key_heads * la.key_head_dim, la.n_heads * la.value_head_dim
        channels = 2 * key_dim + value_dim  # q, k and v pass the convolution
        self.split_projections = la.projections == "split"
        if self.split_projections:
            self.in_proj_qkv = nn.Linear(cfg.d_model, channels, bias=False)
            self.in_proj_z = nn.Linear(cfg.d_model, value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.d_model, la.n_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.d_model, la.n_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(cfg.d_model, 2 * key_dim + 2 * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.d_model, 2 * la.n_heads, bias=False)
        self.conv1d = nn.Conv1d(channels, channels, la.conv_width, groups=channels, bias=False)  # its weight only
        self.dt_bias = nn.Parameter(torch.ones(la.n_heads))
        self.A_log = nn.Parameter(torch.zeros(la.n_heads))
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.norm.eps)
        self.out_proj = nn.Linear(value_dim, cfg.d_model, bias=False)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x (B, T, D): mixed q|k|v (B, T, channels), z (B, T, H, Dv), b and a (B, T, H)."""
        batch, length, _ = x.shape
        dk, dv = self.key_head_dim, self.value_head_dim
        if self.split_projections:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(batch, length, -1, dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        # head counts from the shapes: a tensor-parallel shard holds whole key-head groups
        key_heads = self.in_proj_ba.weight.shape[0] * self.n_key_heads // (2 * self.n_heads)
        per_key = self.n_heads // self.n_key_heads  # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(batch, length, key_heads, 2 * dk + 2 * per_key * dv)
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
        if chunk is not None:  # validation refuses the layout (its kind's context_parallel); a direct call lands here
            raise ValueError("linear_attention blocks do not run under context parallel; set parallel.cp=1")
        if padding is not None:
            x = x * padding[..., None].to(x.dtype)
        batch, length, _ = x.shape
        mixed, z, b, a = self._split(x)
        weight = self.conv1d.weight.squeeze(1)
        mixed, conv_state = causal_conv1d(mixed, weight, state=None if cache is None else cache.conv,
                                          doc_ids=documents)
        mixed = F.silu(mixed)
        key_width = weight.shape[0] - z.shape[2] * self.value_head_dim  # q and k channels together
        q, k, v = mixed.split([key_width // 2, key_width // 2, mixed.shape[-1] - key_width], dim=-1)
        q = q.reshape(batch, length, -1, self.key_head_dim)
        k = k.reshape(batch, length, -1, self.key_head_dim)
        v = v.reshape(batch, length, -1, self.value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        state = None if cache is None else cache.state
        if state is not None and length == 1:  # one decoding step: the recurrence is the cheaper form
            out, final = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                                    doc_ids=documents, use_qk_l2norm=True)
        else:
            out, final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=state,
                                                output_final_state=cache is not None, doc_ids=documents,
                                                use_qk_l2norm=True)
        if cache is not None:
            cache.conv, cache.state, cache.length = conv_state, final, cache.length + length
        out = self.norm(out, z).reshape(batch, length, -1)
        return self.out_proj(out)
