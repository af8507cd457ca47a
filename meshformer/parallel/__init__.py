"""Parallel layouts applied from outside the model: mesh, FSDP2/HSDP, tensor/sequence and pipeline parallel.

The trainer calls `build_plan(model, cfg, device, loss_fn)` and talks only to the returned `TrainingPlan`.
"""

from meshformer.parallel.build import build_plan
from meshformer.parallel.plan import TrainingPlan

__all__ = ["TrainingPlan", "build_plan"]
