"""Multi-token prediction (DeepSeek-V3): `model.mtp.depth` sequential modules after the main stack.

Module k (from 1) combines, at each position t, the previous depth's hidden state h_{k-1}[t] (the main stack's
output before its final norm for k = 1) with the embedding of token t + k: both normed (`hnorm`, `enorm`),
concatenated [enorm ; hnorm] as DeepSeek's `eh_proj` reads them, projected 2d -> d, then one block of the model's own
kinds (the last block's) and the module's own final norm (`shared_head.norm` in DeepSeek's checkpoints) before the
shared output head. It predicts token t + k + 1: the main labels shifted by k (`shifted_labels`).

The loss joins the objective as `loss_weight / depth` times each module's mean token loss, each over its own targets
(fewer than the main loss's: targets past the sequence or across a document are dropped); model/transformer.py
returns the modules' summed losses, parallel/parallel_model.py weighs them. Generation never runs these modules.

Under context parallel the token k ahead may sit on another rank: `ahead_inputs` computes every depth's input ids
and targets on the whole sequence, before the batch is split like its other per-token tensors.

Under mHC (model.residual.kind "mhc", DeepSeek-V4) a module reads and returns the n residual streams (B, T, n, D):
module 1 takes the main stack's streams before their merge, as DeepSeek-V4's published MTP block does (its
inference code feeds the last block's (B, T, n, D) output to it; its checkpoint's mtp.0.* holds a block's own
hc_attn_* / hc_ffn_* and an hc_head_* merge of n weights over n x D, so the streams go in unmerged and the module
merges its own). Each stream is normed by `hnorm` and projected by `h_proj`; the normed embedding through `e_proj`
is added to every stream (the two projections are DeepSeek-V3's eh_proj split in its two halves); then the block,
the module's own merge of the streams and its final norm. The next module reads the block's streams.

The block's kinds: model.mtp.layer_type / mlp_type, else the last block's (`block_kinds`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshformer.batch import IGNORE_INDEX
from meshformer.model.config import ModelConfig
from meshformer.model.layers import TransformerBlock, make_norm
from meshformer.model.residual import HyperMerge


def block_kinds(cfg: ModelConfig) -> tuple[ModelConfig, int]:
    """(config, index) whose block `index` has the MTP block's kinds: the last block's (DeepSeek-V3's MTP block is an
    MoE block like its last main block), or model.mtp.layer_type / mlp_type appended as one block past the stack."""
    m, n = cfg.mtp, cfg.n_layers
    if not m.layer_type and not m.mlp_type:
        return cfg, n - 1
    layer_types = [cfg.layer_type(i) for i in range(n)] + [m.layer_type or cfg.layer_type(n - 1)]
    mlp_types = [cfg.mlp_type(i) for i in range(n)] + [m.mlp_type or cfg.mlp_type(n - 1)]
    return replace(cfg, layer_types=layer_types, mlp_types=mlp_types), n


class MtpModule(nn.Module):
    """One depth: the two norms, the projection, a block and the final norm (the output head is the model's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = TransformerBlock(block_kinds(cfg)[0], causal=True, index=block_kinds(cfg)[1])
        self.final_norm = make_norm(cfg)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor, mask: Any, **block_kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h_k, h_k through the final norm) from h_{k-1} and the embeddings of the tokens k ahead; one call, so
        that an FSDP unit of this module gathers its weights around it."""
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        h = self.block(h, mask, **block_kwargs)
        return h, self.final_norm(h)


class HyperMtpModule(nn.Module):
    """One depth under mHC: h_proj(hnorm(stream)) + e_proj(enorm(embedding)) on each of the n streams, the block,
    then the module's own merge of the streams and final norm (the output head is the model's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.enorm = make_norm(cfg)
        self.hnorm = make_norm(cfg)
        self.e_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.h_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.block = TransformerBlock(block_kinds(cfg)[0], causal=True, index=block_kinds(cfg)[1])
        self.merge = HyperMerge(cfg)
        self.final_norm = make_norm(cfg)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor, mask: Any, **block_kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the streams h_k (B, T, n, D), their merge through the final norm (B, T, D)) from the streams h_{k-1}
        and the embeddings (B, T, D) of the tokens k ahead."""
        h = self.h_proj(self.hnorm(previous)) + self.e_proj(self.enorm(embedded)).unsqueeze(2)
        h = self.block(h, mask, **block_kwargs)
        return h, self.final_norm(self.merge(h))


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """x (B, T) moved k places left along the sequence, the last k columns `fill`."""
    if k == 0:
        return x
    return torch.cat([x[:, k:], x.new_full((x.shape[0], min(k, x.shape[1])), fill)], dim=1)[:, :x.shape[1]]


def shifted_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Module k's targets: labels[t + k] (the token k + 1 ahead), ignored where that runs past the sequence or where
    any of labels[t .. t + k] is ignored (padding, a document boundary in between)."""
    out = shift_left(labels, k, IGNORE_INDEX)
    for j in range(k):
        out = out.masked_fill(shift_left(labels, j, IGNORE_INDEX) == IGNORE_INDEX, IGNORE_INDEX)
    return out


def ahead_inputs(input_ids: torch.Tensor, labels: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, targets), each (B, T, depth): column k - 1 holds module k's input token (t + k) and its target."""
    ks = range(1, depth + 1)
    return (torch.stack([shift_left(input_ids, k, 0) for k in ks], dim=-1),
            torch.stack([shifted_labels(labels, k) for k in ks], dim=-1))


def mtp_modules(cfg: ModelConfig) -> nn.ModuleList | None:
    """The modules of `model.mtp.depth` (None when off)."""
    if cfg.mtp.depth == 0:
        return None
    module = HyperMtpModule if cfg.residual.kind == "mhc" else MtpModule
    return nn.ModuleList(module(cfg) for _ in range(cfg.mtp.depth))


__all__ = ["HyperMtpModule", "MtpModule", "ahead_inputs", "block_kinds", "mtp_modules", "shift_left",
           "shifted_labels"]
