"""FSDP2 (`fully_shard`) per block and at the root; HSDP when the data mesh is 2-D (replicate, shard)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementFnResult

from meshformer.config import ParallelConfig
from meshformer.model import Transformer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision_policy(cfg: ParallelConfig) -> MixedPrecisionPolicy:
    """Parameters all-gathered in `mixed_precision_param`, gradients reduced in `mixed_precision_reduce`.

    Sharded master weights and optimizer state stay fp32 whatever the policy.
    """
    return MixedPrecisionPolicy(param_dtype=_DTYPES[cfg.mixed_precision_param],
                                reduce_dtype=_DTYPES[cfg.mixed_precision_reduce])


def blocks_of(model: Transformer) -> list[nn.Module]:
    """The blocks the family spec names as units, in execution order, for per-block wrapping."""
    return [block for _, block in model.spec.blocks(model)]


def apply_fsdp(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig, *, reshard_after_forward: bool | None = None,
               placement: Callable[[nn.Parameter], ShardPlacementFnResult] | None = None) -> nn.Module:
    """Shard every block, then the root (embeddings, norms, head: whatever is left).

    Per-block units bound the unsharded memory to about one block at a time; the root unit holds the
    embeddings and the output head, which are used at the two ends of the forward pass, so it is never
    resharded after forward (it would be all-gathered again at once for the head / in backward). `placement`:
    the blocks' `shard_placement_fn` (expert weights on their own mesh).
    """
    policy = mixed_precision_policy(cfg)
    reshard = cfg.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=placement)
    for module in model.mtp_layers or ():  # multi-token prediction: a unit each, its experts placed as the blocks'
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    sum_gradients(model)
    return model


def sum_gradients(model: nn.Module) -> None:
    """Make FSDP sum gradients over data-parallel ranks instead of averaging them.

    Each rank's loss is already divided by the *global* token count (see ParallelModel.forward_backward), so the
    sum over ranks is exactly the gradient of the global mean. Forcing SUM-only collectives keeps gloo (which has
    no PREMUL_SUM) and NCCL on the same path.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
