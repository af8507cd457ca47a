"""Parallel layouts applied from outside the model: mesh, FSDP2/HSDP, tensor/sequence and pipeline parallel."""

from __future__ import annotations

import torch
from torch import nn

from meshformer.config import Config
from meshformer.parallel.plan import LossFn, TrainingPlan


def build_plan(model: nn.Module, cfg: Config, device: torch.device, loss_fn: LossFn) -> TrainingPlan:
    """The training plan for this process's world (single device when not launched distributed)."""
    model.to(device)
    return TrainingPlan(model, loss_fn, device)


__all__ = ["TrainingPlan", "build_plan"]
