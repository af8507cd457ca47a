"""Multi-head latent attention (MLA), as DeepSeek-V2 / V3 define it.

Each token writes one compressed latent c = RMSNorm(x W_kv_a) of width kv_lora_rank and one rotary key k_rope of
width qk_rope_head_dim shared by every head; the heads' keys and values are expanded from the latent:
[k_nope | v] = c W_kv_b (per head qk_nope_head_dim and v_head_dim), each head's key is [k_nope | k_rope]. Queries
come through a low-rank path q = RMSNorm(x W_q_a) W_q_b (q_lora_rank) or one projection (q_lora_rank None,
DeepSeek-V2-Lite), split the same way into a position-free part and a rotated part. Scores are scaled by
1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's mscale^2 when the rotary frequencies are scaled
(mla.mscale_all_dim), and the heads' outputs (v_head_dim each) go through o_proj.

The generation cache holds what each token wrote, the latent and the rotated key (`KVCache.k` and `.v`, one
"head" each), not the expanded keys and values. Context parallel gathers the same two tensors.

Rotary layout: DeepSeek's checkpoints rotate interleaved pairs (2i, 2i + 1) (mla.rope_interleave). Queries and keys
are both de-interleaved (evens, then odds) and rotated half-split, which gives the same scores as rotating the
pairs in place and is how transformers computes it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from meshformer.model.attention import KEEP, ROOT, WHOLE, KVCache, SequenceChunk, sdpa_order
from meshformer.model.config import ModelConfig
from meshformer.model.masks import AttentionMask
from meshformer.model.positions import apply_rope

# The latent norms' epsilon: DeepSeek's reference fixes it (the block norms' model.norm.eps does not apply)
LATENT_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_scale(cfg: ModelConfig) -> float:
    """The score multiplier: attention.scale if set, else 1/sqrt(qk head width), times mscale(factor,
    mscale_all_dim)^2 under scaled RoPE."""
    if cfg.attention.scale is not None:
        return cfg.attention.scale
    scale = cfg.mla.qk_head_dim ** -0.5
    if cfg.mla.mscale_all_dim and cfg.rope.scaling != "none":
        scale *= yarn_mscale(cfg.rope.factor, cfg.mla.mscale_all_dim) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Columns (0, 1, 2, 3, ...) -> (0, 2, ..., 1, 3, ...): interleaved rotary pairs into the half-split layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """Causal self-attention through a compressed key/value latent (see the module docstring).

    Head counts are inferred from tensor shapes: tensor parallel splits q_proj / q_b_proj / kv_b_proj by heads and
    o_proj by its input, and replicates the down-projections and their norms (`shared_key`).
    """

    max_logit: torch.Tensor  # a buffer (see `record_max_logit`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m, heads, d = cfg.mla, cfg.attention.n_heads, cfg.d_model
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = (m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                                  m.v_head_dim, m.kv_lora_rank)
        self.qk_dim = m.qk_head_dim
        self.interleave = m.rope_interleave
        self.scale = mla_scale(cfg)
        # DeepSeek's biases (attention_bias) sit on the down-projections and the output only
        self.q_proj = nn.Linear(d, heads * self.qk_dim, bias=False) if m.q_lora_rank is None else None
        self.q_a_proj = nn.Linear(d, m.q_lora_rank, bias=cfg.bias) if m.q_lora_rank is not None else None
        self.q_a_norm = nn.RMSNorm(m.q_lora_rank, eps=LATENT_NORM_EPS) if m.q_lora_rank is not None else None
        self.q_b_proj = nn.Linear(m.q_lora_rank, heads * self.qk_dim, bias=False) if m.q_lora_rank is not None \
            else None
        self.kv_a_proj = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.bias)
        self.kv_a_norm = nn.RMSNorm(m.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * m.v_head_dim, d, bias=cfg.bias)
        self.dropout_p = cfg.attention.dropout
        self.use_math = cfg.attention.backend == "math"
        self.sdpa_order = sdpa_order(cfg.attention.backend)
        self.capture_weights = False  # inspection hook: keep the last attention weights in `.weights`
        self.weights: torch.Tensor | None = None
        # The shared rotary key passes through here: tensor parallel sums its gradient over the ranks, each of whose
        # heads contributes a share (the kind's PARTIAL_GRADIENT rule, model/components/mla.py)
        self.shared_key = nn.Identity()
        # MuonClip (train/qk_clip.py) sets `record_max_logit`: each training forward then runs the math path and
        # keeps, per query head of this rank, the largest logit q·k·scale over the keys each query sees in
        # `max_logit[:heads]`, a running max until the clip resets it
        self.record_max_logit = False
        self.register_buffer("max_logit", torch.full((heads,), float("-inf")), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """After a meta build: no logit recorded yet."""
        self.max_logit.fill_(float("-inf"))

    def qk_clip_rows(self) -> list[tuple[nn.Linear, int, list[int]]]:
        """MuonClip's rule for MLA (Kimi K2): per head, the position-free query and key rows by sqrt(gamma), the
        rotary query rows by gamma, the values and the shared rotary key untouched (`train/qk_clip.py`)."""
        queries = self.q_proj if self.q_proj is not None else self.q_b_proj
        assert queries is not None
        return [(queries, self.qk_dim, [ROOT] * self.nope_dim + [WHOLE] * self.rope_dim),
                (self.kv_b_proj, self.nope_dim + self.v_dim, [ROOT] * self.nope_dim + [KEEP] * self.v_dim)]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, T, qk head width) queries of x (B, T, d_model)."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        batch, length, _ = x.shape
        return q.view(batch, length, -1, self.qk_dim).transpose(1, 2)

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if rope is None:
            return x
        return apply_rope(deinterleave(x) if self.interleave else x, rope)

    def _expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (B, H, Tk, qk head width) and values (B, H, Tk, v_head_dim) from the latents (B, 1, Tk, rank) and
        the rotated shared keys (B, 1, Tk, rope width)."""
        batch, _, length, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(batch, length, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        *,
        memory: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
        cache: KVCache | None = None,
        chunk: SequenceChunk | None = None,
        query_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Self-attention of x (B, T, d_model); `memory` and `bias` are not taken (config validation keeps MLA to
        causal stacks). rope None (model.position "none", Kimi Linear's MLA): the rotary part of the queries and the
        shared key enter unrotated. chunk: under context parallel, the pieces of the sequence `x` holds.
        query_scale: each query's multiplier (positions.query_scale, Llama 4's length scaling), after RoPE."""
        if memory is not None or bias is not None:
            raise ValueError("multi-head latent attention is causal self-attention only: use it in a decoder stack")
        batch, length, _ = x.shape
        q_nope, q_rope = self._queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent).view(batch, 1, length, self.kv_rank)
        k_rope = self.shared_key(k_rope)
        k_rope = self._rotate(k_rope.view(batch, 1, length, self.rope_dim), rope)
        q = torch.cat([q_nope, self._rotate(q_rope, rope)], dim=-1)
        if query_scale is not None:
            q = q * query_scale.to(q.dtype)
        if chunk is not None and chunk.ulysses:  # per-head queries, keys and values travel, heads for pieces
            k, v = self._expand(latent, k_rope)
            out = chunk.to_sequence(self._attend(chunk.to_heads(q), chunk.to_heads(k), chunk.to_heads(v), mask))
            return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        if chunk is not None:  # the whole sequence's latents and rotated keys: the compressed tensors travel
            latent, k_rope = chunk.whole(latent), chunk.whole(k_rope)
        if cache is not None:
            if cache.k is not None and cache.v is not None:
                latent, k_rope = torch.cat([cache.k, latent], dim=2), torch.cat([cache.v, k_rope], dim=2)
            cache.k, cache.v = latent, k_rope
        k, v = self._expand(latent, k_rope)
        if chunk is not None:
            # each piece's queries against the keys up to its end, with its rows of a padding or document mask
            pieces = []
            for start, n, at in chunk.spans(length):
                piece_mask = mask if mask.mask is None else AttentionMask(mask.mask[..., start:start + n, :at + n])
                pieces.append(self._attend(q[:, :, start:start + n], k[:, :, :at + n], v[:, :, :at + n], piece_mask))
            out = torch.cat(pieces, dim=2)
        else:
            out = self._attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """Softmax attention; values narrower than queries and keys, which SDPA takes as they are."""
        dropout_p = self.dropout_p if self.training else 0.0
        if self.use_math or self.capture_weights or (self.record_max_logit and self.training):
            return self._math(q, k, v, mask, dropout_p)
        if self.sdpa_order is None:
            return self._sdpa(q, k, v, mask, dropout_p)
        with sdpa_kernel(self.sdpa_order, set_priority=True):
            return self._sdpa(q, k, v, mask, dropout_p)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              dropout_p: float) -> torch.Tensor:
        if mask.mask is None and mask.is_causal and q.shape[2] != k.shape[2]:  # SDPA's is_causal: top left
            lower_right = (mask.materialize(q.shape[2], k.shape[2], q.device) if torch.compiler.is_compiling()
                           else causal_lower_right(q.shape[2], k.shape[2]))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=lower_right, dropout_p=dropout_p,
                                                  scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.mask, dropout_p=dropout_p,
                                              is_causal=mask.mask is None and mask.is_causal, scale=self.scale)

    def _math(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
              dropout_p: float) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1)) * self.scale
        allowed = mask.materialize(q.shape[2], k.shape[2], q.device)
        if allowed is not None:  # a finite fill: no row is ever all -inf
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if self.record_max_logit and self.training:
            per_head = scores.detach().amax(dim=(0, 2, 3))
            if isinstance(per_head, DTensor):  # heads sharded over tensor-parallel ranks: this rank's heads
                per_head = per_head.to_local()
            seen = self.max_logit[:per_head.shape[0]]
            torch.maximum(seen, per_head.to(seen.dtype), out=seen)
        weights = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype)
        if self.capture_weights:
            self.weights = weights.detach()
        return F.dropout(weights, p=dropout_p, training=dropout_p > 0) @ v
