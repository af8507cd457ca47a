"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, GLM-5): multi-head latent attention (model/mla.py) whose queries
each attend only to the `dsa.topk` keys a lightning indexer scores highest.

The lightning indexer of a block: n_heads queries per token from the MLA query latent, q = wq_b(c_q) (head_dim
each), one key per token k = LayerNorm(wk(x)), both rotated on their first qk_rope_head_dim dimensions (half-split
pairs in DeepSeek-V3.2, interleaved in GLM-5: dsa.rope_interleave), and per-head weights w = weights_proj(x) /
sqrt(n_heads). Query t scores key s as I[t, s] = sum_h w[t, h] relu(q[t, h] . k[s] / sqrt(head_dim)) (in fp32).
Among the keys its mask allows (causal, padding, documents) the top k by I are kept: the attention mask becomes
allowed & selected, so attention is exactly MLA's over those keys, and dense MLA where topk covers every key.

Shared selection (GLM-5's indexer_types "shared"): a block of the kind `dsa_shared` holds no indexer and attends to
the keys the nearest earlier `dsa` block selected in the same forward, handed on through the blocks' `carry` (keyed
by that block's index, so recomputation in any order reads the right one).

Cache: the indexer keys sit beside the latent and rotary key (`IndexedKVCache.index_k`); context parallel gathers
them as it gathers the latent.

Training (DeepSeek-V3.2's indexer objective): the indexer reads detached inputs, so the language-model loss never
reaches it and its own loss reaches nothing else. Per query, its loss is the KL divergence from the main
attention's distribution p (the heads' probabilities summed, renormalised) to softmax(I) over the same keys: every
allowed key in the dense warm-up (dsa.stage = "warmup", where attention is dense and only the indexers train), the
selected ones in the sparse stage. Its gradient in I is the cross-entropy's (p's entropy is a constant), which is
linear in p: under tensor parallel each rank's heads give their share, and the scores sum their gradient over the
ranks (`scores_grad`, the PARTIAL_GRADIENT style). The loss summed over the real queries ("dsa/indexer_loss") is
handed to the objective (meshformer/loss/layer_terms.py), which adds it with its weight (dsa.loss_weight by default)
over the step's target tokens (`set_token_count`), so that it is a mean over the step's tokens under every layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.loss.layer_terms import LayerTerms
from meshformer.model.attention import KVCache, SequenceChunk
from meshformer.model.components.base import Carry
from meshformer.model.config import ModelConfig
from meshformer.model.masks import AttentionMask
from meshformer.model.mla import MultiHeadLatentAttention, deinterleave
from meshformer.model.positions import apply_rope

# The indexer key norm's epsilon, fixed by DeepSeek's reference
INDEXER_NORM_EPS = 1e-6


@dataclass
class IndexedKVCache(KVCache):
    """MLA's cache (k: the latents, v: the rotated shared keys) and the indexer keys (B, 1, T, dsa.head_dim)."""

    index_k: torch.Tensor | None = None


class LightningIndexer(nn.Module):
    """Scores every (query, key) pair of a block (see the module docstring); it picks keys, it attends to nothing."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m, x = cfg.mla, cfg.dsa
        assert m.q_lora_rank is not None  # the kind's check: queries go through a latent
        self.n_heads, self.head_dim, self.rope_dim, self.interleave = (x.n_heads, x.head_dim, m.qk_rope_head_dim,
                                                                       x.rope_interleave)
        self.wq_b = nn.Linear(m.q_lora_rank, x.n_heads * x.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, x.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(x.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(cfg.d_model, x.n_heads, bias=False)
        # every head of this rank reads the scores: tensor parallel sums their gradient over the ranks
        self.scores_grad = nn.Identity()

    def _rotate(self, t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """t (B, H, T, head_dim) rotated on its first rope_dim dimensions (a narrower table rotates only those)."""
        if self.interleave:
            t = torch.cat([deinterleave(t[..., :self.rope_dim]), t[..., self.rope_dim:]], dim=-1)
        return apply_rope(t, rope)

    def keys(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The rotated indexer keys (B, 1, T, head_dim) of x (B, T, d_model)."""
        return self._rotate(self.k_norm(self.wk(x))[:, None], rope)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """I (B, Tq, Tk) in fp32 of the queries x (B, Tq, d_model) with their latent (B, Tq, q_lora_rank) against
        the keys (B, 1, Tk, head_dim)."""
        batch, length, _ = x.shape
        q = self._rotate(self.wq_b(q_latent).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2), rope)
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2) * self.head_dim ** -0.5)  # (B, H, Tq, Tk)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5  # (B, Tq, H)
        # one product per head over every query, then the heads' weighted sum (not B x Tq tiny products)
        return self.scores_grad((scores * weights.transpose(1, 2).unsqueeze(-1)).sum(dim=1))


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA over the keys the block's lightning indexer selects per query; trains the indexer in training mode.
    shared: no indexer of its own; the keys block `source` (an earlier dsa block) selected in this forward."""

    def __init__(self, cfg: ModelConfig, *, shared: bool = False) -> None:
        super().__init__(cfg)
        self.indexer = None if shared else LightningIndexer(cfg)
        # a dsa block followed by dsa_shared blocks hands its selection on
        self.hands_on = not shared and "dsa_shared" in cfg.layer_types
        self.kinds = [cfg.layer_type(i) for i in range(cfg.n_layers)]  # a dsa_shared block's source: the nearest dsa
        self.topk, self.dense = cfg.dsa.topk, cfg.dsa.stage == "warmup"
        self.total_heads = cfg.attention.n_heads
        # the objective's weight of the indexer loss; its scale 1 / the step's target tokens, set before each step
        # (None outside a step: 1 / this call's real queries)
        self.loss_terms = LayerTerms()
        self.last_loss: torch.Tensor | None = None  # the latest training forward's mean KL per real query

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
        padding: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        query_scale: torch.Tensor | None = None,
        carry: Carry | None = None,
        block: int = 0,
    ) -> torch.Tensor:
        """As MultiHeadLatentAttention's; `padding` (B, T): which queries are real tokens (the indexer's loss).
        `query_scale` is not taken (config validation keeps mla.query_scale_beta to mla blocks). carry: what the
        blocks of this forward hand on (a dsa block's selections under its index `block`, for dsa_shared blocks)."""
        if rope is None or memory is not None or bias is not None or query_scale is not None:
            raise ValueError("sparse latent attention is causal self-attention with RoPE only: set "
                             "model.position='rope' and use it in a decoder stack")
        assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
        batch, length, _ = x.shape
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(batch, length, -1, self.qk_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent).view(batch, 1, length, self.kv_rank)
        k_rope = self._rotate(self.shared_key(k_rope).view(batch, 1, length, self.rope_dim), rope)
        q = torch.cat([q_nope, self._rotate(q_rope, rope)], dim=-1)
        train = self.training and torch.is_grad_enabled()
        # the indexer learns from its own loss only: its inputs leave the model's graph
        x_in, q_in = (x.detach(), q_latent.detach()) if train else (x, q_latent)
        index_k = self.indexer.keys(x_in, rope) if self.indexer is not None else None
        if chunk is not None:  # the whole sequence's compressed tensors, the indexer keys beside them
            latent, k_rope = chunk.whole(latent), chunk.whole(k_rope)
            index_k = chunk.whole(index_k) if index_k is not None else None
        if isinstance(cache, IndexedKVCache):
            if cache.k is not None and cache.v is not None:
                latent, k_rope = torch.cat([cache.k, latent], dim=2), torch.cat([cache.v, k_rope], dim=2)
                if cache.index_k is not None and index_k is not None:
                    index_k = torch.cat([cache.index_k, index_k], dim=2)
            cache.k, cache.v, cache.index_k = latent, k_rope, index_k
        handed = self._handed(carry, block)
        k, v = self._expand(latent, k_rope)
        keys = k.shape[2]
        spans = chunk.spans(length) if chunk is not None else [(0, length, keys - length)]
        pieces, losses, selections = [], [], []
        for i, (start, n, at) in enumerate(spans):
            whole = chunk is None
            piece_mask = mask if whole or mask.mask is None else AttentionMask(mask.mask[..., start:start + n,
                                                                                         :at + n])
            rows = slice(start, start + n)
            piece_rope = (rope[0][..., rows, :], rope[1][..., rows, :])  # (T, D), or per row under left padding
            q_p, k_p, v_p = q[:, :, rows], k[:, :, :at + n], v[:, :, :at + n]
            allowed = piece_mask.materialize(n, at + n, x.device)
            sparse = not self.dense and self.topk < at + n
            scores, selected = None, None
            if self.indexer is None:  # the source block's selection of these rows (None: it attended densely)
                selected = handed[i]
            elif sparse or train:
                assert index_k is not None
                with torch.set_grad_enabled(train):
                    scores = self.indexer(x_in[:, rows], q_in[:, rows], index_k[:, :, :at + n], piece_rope)
            if sparse and scores is not None:
                assert allowed is not None  # causal: always a mask to materialise
                selected = _top_keys(scores.detach(), allowed, self.topk)
            if selected is not None:
                assert allowed is not None
                piece_mask = AttentionMask(allowed & selected[:, None])
            selections.append(selected)
            pieces.append(self._attend(q_p, k_p, v_p, piece_mask))
            if train and scores is not None:
                real = padding[:, rows] if padding is not None else None
                losses.append(self._indexer_loss(q_p, k_p, scores, piece_mask.materialize(n, at + n, x.device),
                                                 real))
        if self.hands_on and carry is not None:
            carry.items[("dsa", block)] = selections
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]
        out = self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        if losses:
            total, count = (torch.stack(t).sum() for t in zip(*losses))
            self.last_loss = total.detach() / count.clamp(min=1)
            out = self.loss_terms.add(out, {"dsa/indexer_loss": total}, 1 / count.clamp(min=1))
        return out

    def term_values(self) -> dict[str, torch.Tensor]:
        """The latest training forward's indexer loss (mean KL per real query; under tensor parallel, this rank's
        heads' share of the main attention), for the objective's logged parts; none before one or without an
        indexer."""
        return {} if self.last_loss is None else {"dsa/indexer_loss": self.last_loss}

    def _handed(self, carry: Carry | None, block: int) -> list[torch.Tensor | None]:
        """A dsa_shared block's source selections: those of the nearest earlier dsa block (GLM-5's "shared")."""
        if self.indexer is not None:
            return []
        source = max((i for i in range(min(block, len(self.kinds))) if self.kinds[i] == "dsa"), default=None)
        if carry is None or ("dsa", source) not in carry.items:
            raise ValueError(f"dsa_shared block {block} reuses the key selection of dsa block {source}, which did not "
                             "run before it in this forward (another pipeline stage, or none): start each pipeline "
                             "stage and the multi-token prediction block with a dsa block")
        return carry.items[("dsa", source)]  # type: ignore[return-value]

    def _indexer_loss(self, q: torch.Tensor, k: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor | None,
                      real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed KL of the real queries' indexer distributions from this rank's heads' share of the main
        attention, the real queries): over the keys the attention read (`allowed`)."""
        with torch.no_grad():  # p: the main attention's probabilities, summed over the heads
            logits = (q @ k.transpose(-2, -1)).float() * self.scale
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            p = torch.softmax(logits, dim=-1).sum(dim=1) / self.total_heads  # (B, Tq, Tk); this rank's heads' share
        inside = allowed[:, 0] if allowed is not None else torch.ones_like(p, dtype=torch.bool)
        log_q = torch.log_softmax(scores.masked_fill(~inside, float("-inf")), dim=-1)
        # KL(p || q) = sum p log p - sum p log q; the first term is a constant of the indexer
        entropy = torch.where(p > 0, p * p.clamp(min=1e-30).log(), 0.0).sum(-1)
        kl = entropy - torch.where(inside, p * log_q, 0.0).sum(-1)  # (B, Tq)
        if real is None:
            return kl.sum(), torch.tensor(float(kl.numel()), device=kl.device)
        real = real.to(kl.device).bool().expand_as(kl)
        return kl[real].sum(), real.sum().float()


def _top_keys(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """(B, Tq, Tk) bool: the `topk` allowed keys of each query with the highest indexer scores (a row with fewer
    allowed keys keeps them all). Equal scores (ReLU's zeros) go to the earlier key: the same keys whatever the row's
    length (a decode step, a context-parallel piece), where torch.topk's choice among ties depends on it."""
    masked = scores.masked_fill(~allowed[:, 0], float("-inf"))
    picked = masked.sort(dim=-1, descending=True, stable=True).indices[..., :min(topk, scores.shape[-1])]
    return torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, picked, True)


def dsa_layers(modules: Iterable[nn.Module]) -> list[SparseLatentAttention]:
    """Every sparse latent attention inside `modules` (the model parts of a rank)."""
    return [m for part in modules for m in part.modules() if isinstance(m, SparseLatentAttention)]


class HasLayerTerms(Protocol):
    """A layer whose loss terms join the objective (`LayerTerms`)."""

    loss_terms: LayerTerms


def set_token_count(layers: Iterable[HasLayerTerms], tokens: torch.Tensor) -> None:
    """The step's target tokens (every rank and micro-batch): each indexer loss (DSA's, CSA's: `layers` with a
    `loss_terms`) joins as a mean over them."""
    for layer in layers:
        layer.loss_terms.scale = 1 / tokens.clamp(min=1).float()


__all__ = ["IndexedKVCache", "LightningIndexer", "SparseLatentAttention", "dsa_layers", "set_token_count"]
