"""The true global gradient norm over every shard, replica and pipeline stage, and clipping by it.

Each rank holds local pieces of gradients: DTensor shards (FSDP, TP, both), plain tensors replicated over
tensor-parallel ranks, or whole tensors owned by one pipeline stage. A piece's squared norm is weighted by
1 / (number of ranks holding an identical copy of it) and one all-reduce over the world adds everything up,
so every element of every parameter counts exactly once whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def settle_grad(param: torch.Tensor) -> None:
    """Give a DTensor gradient its parameter's placements.

    Autograd can leave a gradient Partial (a pending sum) or Replicate where the parameter is Shard, e.g. the
    vocabulary-sharded embedding's gradient; norms, clipping and cross-stage sums need the parameter's layout.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _shards(grad: torch.Tensor) -> int:
    if not isinstance(grad, DTensor):
        return 1
    mesh = grad.device_mesh
    # FSDP over a TP-sharded dim is a _StridedShard, which does not report is_shard().
    return math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, (Shard, _StridedShard)))


def global_grad_norm(grads: Iterable[torch.Tensor], ranks_per_stage: int, device: torch.device) -> torch.Tensor:
    """L2 norm of the full gradient; `ranks_per_stage` = world size / pipeline degree (ranks holding one stage).

    One multi-tensor norm kernel per (copies, dtype, device) group, as torch's clip_grad_norm_ does, instead of
    a few small kernels per parameter (hundreds of launches a step at GPT-2 XL depth)."""
    groups: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        local = local_tensor(grad)
        groups.setdefault((ranks_per_stage // _shards(grad), local.dtype, local.device), []).append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (copies, _, _), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        total += torch.stack(norms).square().sum().to(device) / copies
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.sqrt()


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply gradients (DTensor or plain) in place by a scalar tensor, one multi-tensor kernel."""
    locals_ = [local_tensor(g) for g in grads]
    if locals_:
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))

