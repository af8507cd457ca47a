"""Parallel layouts applied from outside the model: mesh, FSDP2/HSDP, tensor/sequence and pipeline parallel.

The trainer calls `parallelize(model, cfg, device, loss_fn)` and talks only to the returned `ParallelModel`.
"""

from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.parallelize import parallelize

__all__ = ["ParallelModel", "parallelize"]
