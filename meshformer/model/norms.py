"""Norms: LayerNorm, RMSNorm, and RMSNorm scaling by (offset + weight) (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshformer.model.config import ModelConfig


class OffsetRMSNorm(nn.RMSNorm):
    """RMSNorm scaling by (offset + weight) (Gemma's 1 + weight): the weight stays as checkpoints store it."""

    def __init__(self, width: int, eps: float, offset: float) -> None:
        super().__init__(width, eps=eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + self.offset, self.eps)


def make_rms_norm(cfg: ModelConfig, width: int) -> nn.Module:
    if cfg.norm.weight_offset:
        return OffsetRMSNorm(width, cfg.norm.eps, cfg.norm.weight_offset)
    return nn.RMSNorm(width, eps=cfg.norm.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm.kind == "rmsnorm":
        return make_rms_norm(cfg, cfg.d_model)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm.eps, bias=cfg.bias)
