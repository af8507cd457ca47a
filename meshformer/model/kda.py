"""Kimi Delta Attention (KDA), the token mixer of the "kda" blocks (Kimi Linear's `KimiLinearDeltaAttention`).

Gated DeltaNet (model/linear_attention.py) with a forget gate per key channel rather than per head. Per token:
q, k and v come from their own projections (`q_proj`, `k_proj`, `v_proj`, as many query/key heads as value heads),
pass short causal depthwise convolutions (`q_conv1d`, `k_conv1d`, `v_conv1d`, no bias) and SiLU; q and k are
L2-normalised inside the rule. The forget gate is a low-rank projection to every key channel, `f_b_proj(f_a_proj(x))`
(rank: the key head width), and the log decay is g = -exp(A_log[head]) * softplus(f + dt_bias[channel]). The write
strength is beta = sigmoid(b_proj(x)) per head. Each head runs the gated delta rule with that per-channel decay
(model/gated_delta.py). Its output is RMS-normalised per head, scaled by `norm.weight` and gated by
sigmoid(g_b_proj(g_a_proj(x))) (a low-rank output gate, rank: the value head width), then projected back
(`out_proj`). No linear here has a bias.

What it shares with Gated DeltaNet, unchanged: padding tokens enter as zeros, packed documents restart the state and
the convolution window, generation carries both in a `LinearCache` (one decoding step runs the recurrence), context
parallel passes the state piece by piece, and tensor parallel splits it by head: the head-major projections (q, k, v,
b, f_b, g_b) colwise, A_log, dt_bias and the convolutions' channels with their heads, the gated norm's weight whole
on every rank with its gradient summed. The low-rank down-projections f_a_proj and g_a_proj are
replicated (each rank's up-projection sums their output's gradient). Its kind, `kda`, is declared in
model/components/kda.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.config import ModelConfig
from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.model.gated_delta_fla import fla_importable, fla_kda_rule
from meshformer.model.linear_attention import GatedDeltaNet, GatedRMSNorm, HeadShard, _part, head_channels
from meshformer.model.sharded import local_part


class KimiDeltaAttention(GatedDeltaNet):
    """The KDA token mixer; head count and widths from `[model.linear_attention]` (n_key_heads = n_heads)."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        la, d = cfg.linear_attention, cfg.d_model
        self.n_heads = self.n_key_heads = la.n_heads
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        self.chunk_size = la.chunk_size
        self.backend = la.backend
        key_dim, value_dim = la.n_heads * la.key_head_dim, la.n_heads * la.value_head_dim
        self.q_proj = nn.Linear(d, key_dim, bias=False)
        self.k_proj = nn.Linear(d, key_dim, bias=False)
        self.v_proj = nn.Linear(d, value_dim, bias=False)
        # one depthwise convolution each for q, k and v (their weights only), as the checkpoints store them
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(width, width, la.conv_width, groups=width, bias=False) for width in (key_dim, key_dim, value_dim))
        self.f_a_proj = nn.Linear(d, la.key_head_dim, bias=False)
        self.f_b_proj = nn.Linear(la.key_head_dim, key_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(key_dim))  # per key channel
        self.A_log = nn.Parameter(torch.zeros(la.n_heads))  # per head
        self.b_proj = nn.Linear(d, la.n_heads, bias=False)
        self.g_a_proj = nn.Linear(d, la.value_head_dim, bias=False)
        self.g_b_proj = nn.Linear(la.value_head_dim, value_dim, bias=False)
        self.norm = GatedRMSNorm(la.value_head_dim, cfg.norm.eps, activation=torch.sigmoid)
        self.out_proj = nn.Linear(value_dim, d, bias=False)
        self.head_shard: HeadShard | None = None

    def shard_heads(self, ranks: int, rank: int, sum_gradient: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[list[str], list[str]]:
        """A_log (per head), dt_bias and the q, k, v convolutions (per channel, head-major) split with the heads; the
        gated norm's weight whole."""
        channels = head_channels(self.n_heads, self.key_head_dim, self.n_heads, self.value_head_dim, ranks, rank)
        self.head_shard = HeadShard(channels, sum_gradient)
        return ["A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"], ["norm.weight"]

    def _conv_weight(self) -> torch.Tensor:
        """[q | k | v] taps of this rank's heads: each convolution holds its own channels (head-major)."""
        return torch.cat([local_part(c.weight) for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]).squeeze(1)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections of x (B, T, D): [q | k | v] (B, T, channels), the output gate (B, T, H, Dv), b (B, T, H)
        and the forget gate's input f (B, T, H * Dk), this rank's heads under tensor parallel."""
        batch, length, _ = x.shape
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        gate = self.g_b_proj(self.g_a_proj(x)).view(batch, length, -1, self.value_head_dim)
        return mixed, gate, self.b_proj(x), self.f_b_proj(self.f_a_proj(x))

    def _chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                 initial_state: torch.Tensor | None, output_final_state: bool, doc_ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chunked rule with per-channel decays on the configured backend (fla: `chunk_kda`)."""
        if self.backend == "fla" or (self.backend == "auto" and q.is_cuda and fla_importable()):
            return fla_kda_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                                doc_ids=doc_ids, use_qk_l2norm=True)
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size, initial_state=initial_state,
                                      output_final_state=output_final_state, doc_ids=doc_ids, use_qk_l2norm=True)

    def _rule_inputs(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     part: tuple[int, int] | None = None) -> tuple[torch.Tensor, ...]:
        """q, k (B, T, H, Dk), v (B, T, H, Dv), the per-channel log decay g (B, T, H, Dk) and beta (B, T, H)."""
        batch, length, _ = mixed.shape
        key_width = a.shape[-1]
        q, k, v = F.silu(mixed).split([key_width, key_width, mixed.shape[-1] - 2 * key_width], dim=-1)
        shape = (batch, length, -1, self.key_head_dim)
        decay_rate = _part(self.A_log, part).float().exp()[:, None]  # (H, 1): one rate per head, over its channels
        g = -decay_rate * F.softplus(a.float() + _part(self.dt_bias, part).float()).view(shape)
        return (q.reshape(shape), k.reshape(shape), v.reshape(batch, length, -1, self.value_head_dim), g,
                b.sigmoid())
