"""Expert parallelism: each MoE layer's experts split over the `ep` ranks, tokens exchanged all-to-all.

The ep ranks hold different tokens (ep is taken from dp_shard x cp x tp, see meshformer/parallel/mesh.py). Every
rank routes its own tokens and sorts them by expert (model/moe.py); the `Experts` module's exchange (this file):

1. dispatch: the token counts per expert go all-to-all (each rank learns how many rows it receives from each peer
   for each of its experts), then the rows themselves, with variable splits;
2. the received rows, ordered (source rank, expert), are regrouped by expert, so the rank's experts run as one
   grouped computation;
3. combine: the results are put back in arrival order and sent home all-to-all; the router weights and the sum over
   each token's experts run where the token lives.

Both exchanges are differentiable (the backward is the opposite exchange), so every expert's gradient is the sum
over all tokens routed to it on any ep rank. Expert weights become distributed tensors sharded on dim 0 over the ep
mesh: checkpoints hold whole experts and reshard to another ep degree, and FSDP shards them further over the
data-parallel ranks ep leaves (`expert_fsdp`), inside each block's FSDP unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# Per-parameter meshes within one FSDP unit (torch 2.13; torchtitan uses the same for its experts)
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    ShardPlacementFnResult,
    ShardPlacementResult,
)
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshformer.model.moe import Experts, MoEFeedForward, gather_rows, moe_layers
from meshformer.parallel_dims import expert_shard_dim


class ExpertExchange:
    """`Experts.exchange` over `mesh`: the rows go to the ranks holding their experts and come back. It keeps no
    state between calls and uses torch's functional collectives, so torch.compile traces a whole MoE block (with
    `capture_scalar_outputs`, as `compile_blocks` sets for MoE models: the splits are read on the host)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.ranks = mesh.size()

    def __call__(self, xs: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`xs`: rows sorted by global expert, `counts[e]` of them for expert e -> the experts' outputs, same order."""
        ranks = self.ranks
        with torch.no_grad():
            # [source rank, local expert]: rows coming here
            incoming = funcol.all_to_all_single(counts, None, None, self.group).view(ranks, -1)
            # The splits decide buffer sizes: one host read per layer for both (as in every variable-split exchange)
            sizes = torch.cat([counts.view(ranks, -1).sum(1), incoming.sum(1)]).tolist()
        sent, received = sizes[:ranks], sizes[ranks:]
        rows = funcol.all_to_all_single_autograd(xs, received, sent, self.group)  # by source rank, then expert
        local_experts = incoming.shape[1]
        expert_of_row = torch.repeat_interleave(torch.arange(local_experts, device=xs.device).repeat(ranks),
                                                incoming.reshape(-1), output_size=rows.shape[0])
        regroup = torch.argsort(expert_of_row, stable=True)  # -> by expert, then source rank
        arrival_order = torch.empty_like(regroup).scatter_(0, regroup, torch.arange(regroup.numel(), device=xs.device))
        out = compute(gather_rows(rows, regroup, arrival_order), incoming.sum(0))
        return funcol.all_to_all_single_autograd(gather_rows(out, arrival_order, regroup), sent, received, self.group)


def shard_experts(experts: Experts, mesh: DeviceMesh) -> None:
    """Stacked expert weights -> distributed tensors holding this rank's experts (dim 0), no communication: every
    rank built the same (or a meta) model."""
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


def apply_expert_parallel(part: nn.Module, mesh: DeviceMesh) -> int:
    """Split every MoE layer's experts of `part` over `mesh`; returns how many layers."""
    layers = [layer for _, layer in moe_layers(part)]
    for layer in layers:
        shard_experts(layer.experts, mesh)
        layer.experts.exchange = ExpertExchange(mesh)
    return len(layers)


def expert_shard_placement(part: nn.Module, mesh: DeviceMesh) -> Callable[[nn.Parameter], ShardPlacementFnResult]:
    """`shard_placement_fn` for the blocks' FSDP units: expert-parallel weights are sharded over `mesh`, the
    data-parallel ranks ep leaves, the other weights over the block's own mesh. One unit per block, so no FSDP hook
    runs inside a compiled block (torch.compile would break its graph there). The dim: `expert_shard_dim`
    (`parallel_dims.check_expert_parallel` refuses layouts where it does not split evenly)."""
    info = _get_mesh_info(mesh)
    assert isinstance(info, FSDPMeshInfo)  # a 1-D (FSDP) or 2-D (HSDP) data-parallel mesh shards
    shards = mesh.size(-1)
    placements: dict[nn.Parameter, ShardPlacementResult] = {}
    for _, layer in moe_layers(part):
        dim = expert_shard_dim(_local_experts(layer.experts), shards)
        for param in layer.experts.parameters():
            placements[param] = ShardPlacementResult(placement=Shard(dim), mesh_info=info)
    return placements.get


def _local_experts(experts: Experts) -> int:
    up = experts.up_proj
    return up.to_local().shape[0] if isinstance(up, DTensor) else up.shape[0]


def has_moe(part: nn.Module) -> bool:
    return any(isinstance(m, MoEFeedForward) for m in part.modules())


class MeshTokenGroup:
    """`model.moe.TokenGroup` over a stage's meshes: sums over every rank holding other tokens of a micro-batch, or
    other pieces of the same sequences."""

    def __init__(self, tokens: DeviceMesh, sequence: DeviceMesh) -> None:
        self._tokens, self._sequence = tokens.get_group(), sequence.get_group()
        self.sequence_shards = sequence.size()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        dist.all_reduce(t, group=self._tokens)
        return t

    def sum_within_sequences(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        if self.sequence_shards > 1:
            dist.all_reduce(t, group=self._sequence)
        return t
