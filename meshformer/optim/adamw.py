"""AdamW (torch's, with its fastest kernel) on every parameter; weight decay on matrices only (`decays`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from meshformer.optim.optimizer_spec import FP32, OptimizerSpec, SharedKeys, decays, unique_trainable


@dataclass
class AdamWConfig:
    """`[optim.adamw]`; lr, betas, eps and weight_decay are the shared `[optim]` keys."""

    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"  # kernel; auto: fused where it runs


class AdamWSpec(OptimizerSpec):
    name = "adamw"
    table = AdamWConfig
    optimizer_class = torch.optim.AdamW
    state_description = "AdamW moments 2 x fp32"

    def build(self, model_parts: list[nn.Module], shared: SharedKeys, table: AdamWConfig
              ) -> tuple[torch.optim.Optimizer, str]:
        named = unique_trainable(model_parts)
        groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": shared.weight_decay},
                  {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
        # Fused AdamW runs the whole update in one kernel per dtype/device group (CPU and CUDA in torch 2.13).
        kernel = "fused" if table.implementation == "auto" else table.implementation
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[kernel]
        return torch.optim.AdamW(groups, lr=shared.lr, betas=shared.betas, eps=shared.eps, **flags), kernel

    def state_bytes(self, numel: int, matrix_numel: int, matrix_gather: int) -> tuple[float, float]:
        return 2.0 * FP32 * numel, 0.0
