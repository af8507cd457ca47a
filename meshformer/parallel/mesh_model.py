"""The distributed `ParallelModel` without pipelining: FSDP / HSDP / TP(+SP) and their combinations.

Every rank runs the whole model on its data-parallel shard of the batch (under context parallel: its chunk of
each sequence). Losses are sums divided by the *global* token count and FSDP sums (not averages) gradients, so
gradients equal one process on the global batch; tensor-parallel ranks of one data-parallel replica see the same
batch and report the same loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from meshformer.batch import Batch, model_inputs
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import HeadLoss
from meshformer.loss.objective import Loss
from meshformer.parallel.context import sequence_chunk, with_ahead_inputs
from meshformer.parallel.grad_norm import global_grad_norm, settle_grad
from meshformer.parallel.mesh import Meshes
from meshformer.parallel.parallel_model import ParallelModel


class MultiRankParallelModel(ParallelModel):
    """Shared by the mesh- and pipeline-parallel models: data-parallel bookkeeping, global norms, global reductions."""

    def __init__(self, model: nn.Module, loss: Loss | LossFn, device: torch.device, meshes: Meshes, *,
                 autocast_dtype: torch.dtype | None = None, head_loss: HeadLoss | None = None,
                 report: dict[str, str] | None = None) -> None:
        super().__init__(model, loss, device, autocast_dtype=autocast_dtype, head_loss=head_loss, report=report)
        self.meshes, self.dims = meshes, meshes.dims
        self.dp_rank, self.dp_size = meshes.dp_rank, self.dims.dp
        self._replicas_all_reduce = True  # FSDP's setting for HSDP's all-reduce over replicas (its default)

    @property
    def supports_generation(self) -> bool:
        # Pure data parallel: every rank runs the same greedy decode in lockstep (FSDP all-gathers match).
        return not (self.dims.tp_enabled or self.dims.pp_enabled or self.dims.cp_enabled)

    @property
    def _logging_representative(self) -> bool:
        """One rank per data-parallel replica: the last pipeline stage's first tensor-parallel rank."""
        return self.reports_loss and self.meshes.tp_rank == 0

    @staticmethod
    def _sum(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        value = value.detach().clone()
        if mesh.size() > 1:
            dist.all_reduce(value, group=mesh.get_group())
        return value

    def _token_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over every rank holding other tokens of the step (data- and context-parallel ranks)."""
        return self._sum(value, self.meshes.tokens)

    def _local(self, batch: Batch, training: bool = False) -> Batch:
        """This rank's tokens of a data-parallel batch: all of it, or its chunk of each sequence under cp; in training
        with multi-token prediction under cp or pp, with the modules' ids and targets from the whole sequences."""
        if training and self.mtp_depth and (self.dims.cp_enabled or self.dims.pp_enabled):
            batch = with_ahead_inputs(batch, self.mtp_depth)  # pipeline stages take them as keywords
        if not self.dims.cp_enabled:
            return batch
        return sequence_chunk(batch, self.meshes.cp.get_local_rank(), self.dims.cp)

    def _step_sum(self, counts: torch.Tensor) -> torch.Tensor:
        # the context-parallel ranks of a replica share its samples: count whole batches, sum over data parallel
        return self._sum(counts, self.meshes.dp)

    def reduce_for_logging(self, value: torch.Tensor) -> float:
        """Sum of a per-rank quantity (a loss sum of this rank's tokens) over the ranks holding distinct tokens: every
        data- and context-parallel rank, one tensor-parallel rank each, the last pipeline stage; identical on every
        rank (a collective)."""
        value = torch.as_tensor(value, device=self.device, dtype=torch.float32).detach().clone()
        if not self._logging_representative:
            value.zero_()
        dist.all_reduce(value)
        return float(value)

    def _grads(self) -> list[torch.Tensor]:
        seen, grads = set(), []
        for part in self.model_parts:
            for param in part.parameters():
                if id(param) in seen or param.grad is None or not self._counts_in_norm(part, param):
                    continue
                seen.add(id(param))
                settle_grad(param)
                grads.append(param.grad)
        return grads

    def _counts_in_norm(self, part: nn.Module, param: nn.Parameter) -> bool:
        return True

    def _all_reduce_replicas_after(self, last_micro_batch: bool) -> None:
        """HSDP with gradient accumulation: every micro-batch reduce-scatters its gradients within a replica, but only
        the step's last all-reduces them over replicas (usually the slow inter-node links): grad_accum - 1 fewer
        all-reduces a step. FSDP keeps the running sum meanwhile (1/dp_shard of the gradients, reduce dtype)."""
        if self.dims.hsdp and last_micro_batch != self._replicas_all_reduce:  # set on change: it walks every module
            for part in self.model_parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_all_reduce(last_micro_batch)
            self._replicas_all_reduce = last_micro_batch

    def moe_scalars(self) -> dict[str, float]:
        # The statistics are already global over a stage's ranks; pipeline stages hold different layers.
        local = super().moe_scalars()
        if not self.dims.pp_enabled:
            return local
        stages: list[dict[str, float] | None] = [None] * self.dims.pp
        dist.all_gather_object(stages, local, group=self.meshes.pp.get_group())
        return {key: value for stage in stages for key, value in (stage or {}).items()}

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self._grads(), self.dims.world_size // self.dims.pp, self.device)


class MeshParallelModel(MultiRankParallelModel):
    def forward_backward(self, batch: Batch, global_tokens: torch.Tensor, last_micro_batch: bool = True
                         ) -> torch.Tensor:
        self._all_reduce_replicas_after(last_micro_batch)
        return super().forward_backward(self._sequence_parallel_ready(batch, training=True), global_tokens)

    @torch.no_grad()
    def evaluate(self, batch: Batch, loss: Loss | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, tokens = super().evaluate(self._sequence_parallel_ready(batch), loss)
        return self._token_sum(loss_sum), self._token_sum(tokens.to(self.device))

    def _sequence_parallel_ready(self, batch: Batch, training: bool = False) -> Batch:
        """This rank's tokens, checked to split evenly over tensor-parallel ranks."""
        local = self._local(batch, training)
        check_sequence_split(local, self.dims.tp)
        return local


def check_sequence_split(batch: Batch, tp: int) -> None:
    """Sequence parallel splits every stream's length evenly over tensor-parallel ranks."""
    if tp == 1:
        return
    for key, value in model_inputs(batch).items():
        if key.endswith("input_ids") and value.shape[1] % tp:
            raise ValueError(f"sequence parallel needs {key} length divisible by parallel.tp={tp}, got "
                             f"{value.shape[1]}; pad the batch (data.seq_len / data.target_len) to a multiple of tp")
