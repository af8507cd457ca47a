"""Expert parallelism: each MoE layer's experts split over the `ep` ranks, tokens exchanged all-to-all.

The ep ranks hold different tokens (ep is taken from dp_shard x cp x tp, see meshformer/parallel/mesh.py). Every
rank routes its own tokens and sorts them by expert (model/moe.py); around the `Experts` module this file adds:

1. dispatch: the token counts per expert go all-to-all (each rank learns how many rows it receives from each peer
   for each of its experts), then the rows themselves, with variable splits;
2. the received rows, ordered (source rank, expert), are regrouped by expert, so the rank's experts run as one
   grouped computation;
3. combine: the results are put back in arrival order and sent home all-to-all; the router weights and the sum over
   each token's experts run where the token lives.

Both exchanges are differentiable (the backward is the opposite exchange), so every expert's gradient is the sum
over all tokens routed to it on any ep rank. Expert weights become distributed tensors sharded on dim 0 over the ep
mesh: checkpoints hold whole experts and reshard to another ep degree, and FSDP shards them further over the
data-parallel ranks ep leaves (`expert_fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from meshformer.model.moe import Experts, MoEFeedForward, moe_layers


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with variable splits; its gradient travels the opposite way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(out_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
               ) -> torch.Tensor:
    """Rows of `x` in `in_splits` pieces to each rank of `group`; returns `out_splits` rows from each."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class _Exchange:
    """What one dispatch must remember for its combine."""

    sent: list[int]  # rows sent to each ep rank
    received: list[int]  # rows received from each ep rank
    regroup: torch.Tensor  # received rows (by source, then expert) -> rows by expert, then source


class ExpertDispatch:
    """The forward hooks that make one `Experts` module expert-parallel over `mesh`."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group = mesh.get_group()
        self.ranks = mesh.size()
        self._pending: list[_Exchange] = []  # a dispatch waiting for its combine

    def dispatch(self, _module: nn.Module, args: tuple[torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows sorted by global expert, counts per global expert) -> (rows for this rank's experts sorted by
        expert, counts per local expert)."""
        xs, counts = args
        ranks = self.ranks
        incoming = torch.empty_like(counts)  # [source rank, local expert] rows coming here
        dist.all_to_all_single(incoming, counts, group=self.group)
        incoming = incoming.view(ranks, -1)
        # The splits decide buffer sizes: one host sync per layer for both (as in every variable-split exchange).
        sizes = torch.cat([counts.view(ranks, -1).sum(1), incoming.sum(1)]).tolist()
        sent, received = sizes[:ranks], sizes[ranks:]
        rows = all_to_all(xs, received, sent, self.group)
        local_experts = incoming.shape[1]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=xs.device).repeat(ranks), incoming.reshape(-1))
        regroup = torch.argsort(expert_of_row, stable=True)
        self._pending.append(_Exchange(sent, received, regroup))
        return rows[regroup], incoming.sum(0)

    def combine(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        """This rank's expert outputs -> the outputs of the rows this rank sent, in their original order."""
        exchange = self._pending.pop()
        arrival_order = torch.empty_like(exchange.regroup)
        arrival_order[exchange.regroup] = torch.arange(exchange.regroup.numel(), device=out.device)
        return all_to_all(out[arrival_order], exchange.sent, exchange.received, self.group)


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
        dispatch = ExpertDispatch(mesh)
        layer.experts.register_forward_pre_hook(dispatch.dispatch)
        layer.experts.register_forward_hook(dispatch.combine)
    return len(layers)


def shard_experts_with_fsdp(part: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy,
                            reshard_after_forward: bool) -> None:
    """Each expert-parallel `Experts` module its own FSDP unit over the data-parallel ranks ep leaves (before the
    blocks are wrapped, so their units leave these weights alone). Fewer local experts than FSDP ranks: shard the
    experts' rows (dim 1) instead of whole experts, so every rank holds an equal piece."""
    shards = mesh.size(-1)
    for _, layer in moe_layers(part):
        local = _local_experts(layer.experts)

        def placement(param: nn.Parameter, local: int = local) -> Shard:
            return Shard(0) if local % shards == 0 else Shard(1)

        fully_shard(layer.experts, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    shard_placement_fn=placement)


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
