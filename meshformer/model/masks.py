"""Attention masks: padding, causal, their combination, local sliding windows and packed documents.

A mask is boolean, True = may attend, shaped (B or 1, 1, Tq, Tk) to broadcast over heads.
Rows with no allowed key (a query whose keys are all padding) are opened to every key so that
softmax never sees an all -inf row: their outputs are finite and, being padding, are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMask:
    mask: torch.Tensor | None  # bool (B|1, 1, Tq, Tk); None: no masking beyond `is_causal`
    # Causal with no explicit mask: the queries are the last Tq of the Tk key positions (aligned at the bottom
    # right: all of them when Tq == Tk; a KV-cache decode step or a context-parallel piece otherwise).
    is_causal: bool = False

    def materialize(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor | None:
        """The mask as a tensor, for code paths that cannot take `is_causal` (math path, biases)."""
        if self.mask is None and self.is_causal:
            return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None, None]
        return self.mask


def build_mask(
    q_len: int,
    k_len: int,
    *,
    q_offset: int = 0,
    q_positions: torch.Tensor | None = None,
    causal: bool,
    window: int | None = None,
    key_padding: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> AttentionMask:
    """Causal / sliding-window structure plus a key padding mask (B, Tk), True = real token, and the keys'
    document ids (B, Tk): a query attends only to keys of its own document.

    Keys sit at positions 0..k_len-1 and queries at q_offset..q_offset+q_len-1 (q_offset > 0 when
    decoding with a KV cache), or at `q_positions` (a context-parallel rank's pieces). Causal attention whose
    queries are the last keys needs no tensor at all.
    """
    if window is None and key_padding is None and documents is None:
        if not causal:
            return AttentionMask(None)
        if q_positions is None and q_offset + q_len == k_len:
            return AttentionMask(None, is_causal=True)
    per_key = key_padding if key_padding is not None else documents
    if per_key is not None:
        device = per_key.device
    q_pos = torch.arange(q_offset, q_offset + q_len, device=device) if q_positions is None else q_positions
    k_pos = torch.arange(k_len, device=device)
    delta = q_pos[:, None] - k_pos[None, :]  # > 0: the key lies in the past
    structure = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        structure &= delta >= 0
    opened = structure.clone()  # what a row with no allowed key attends to: every key its causality allows
    if window is not None:
        structure &= delta.abs() < window
    mask = structure[None, None]
    if key_padding is not None:
        mask = mask & key_padding[:, None, None, :].bool()
    if documents is not None:
        mask = mask & (documents[:, None, q_pos, None] == documents[:, None, None, :])
    # never an empty row (a padding query without a real key): it attends to every key up to its own (causal) or
    # every key, so that a context-parallel piece, which sees the keys up to its end, computes it as one process
    mask = mask | (~mask.any(dim=-1, keepdim=True) & opened)
    return AttentionMask(mask)


def pool_padding_mask(key_padding: torch.Tensor, factor: int) -> torch.Tensor:
    """A pooled position is real if any position it pools is real (matches `masked_avg_pool`)."""
    batch, length = key_padding.shape
    pad = (-length) % factor
    padded = torch.nn.functional.pad(key_padding.bool(), (0, pad), value=False)
    return padded.view(batch, -1, factor).any(dim=-1)


def masked_avg_pool(x: torch.Tensor, key_padding: torch.Tensor | None, factor: int) -> torch.Tensor:
    """Average (B, T, D) over non-overlapping windows of `factor` positions, ignoring padding."""
    batch, length, dim = x.shape
    pad = (-length) % factor
    weights = torch.ones(batch, length, device=x.device, dtype=x.dtype)
    if key_padding is not None:
        weights = key_padding.to(x.dtype)
    x = torch.nn.functional.pad(x * weights[..., None], (0, 0, 0, pad))
    weights = torch.nn.functional.pad(weights, (0, pad))
    sums = x.view(batch, -1, factor, dim).sum(dim=2)
    counts = weights.view(batch, -1, factor).sum(dim=2, keepdim=True).clamp_min(1.0)
    return sums / counts
