"""A parameter as this rank holds it: parallel code (meshformer/parallel/) may have made it a DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (tensor or expert parallel makes it a DTensor); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
