"""Plain single-device Transformer models; parallelism is applied from outside (meshformer.parallel)."""

from meshformer.model.transformer import Transformer, count_parameters

__all__ = ["Transformer", "count_parameters"]
