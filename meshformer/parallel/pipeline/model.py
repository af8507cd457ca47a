"""The pipeline-parallel `ParallelModel` (optionally with FSDP and TP inside each stage).

One `forward_backward` call is one schedule step over `parallel.pp_microbatches` microbatches of the
trainer's micro-batch. Losses are summed token losses divided by the global token count and the schedule
does not rescale gradients (`scale_grads=False`), so gradient accumulation composes as without pipelining.
With a fused head loss the last stage returns each microbatch's summed loss itself (the labels travel with
the model inputs) and the schedule's loss function only divides it by the global token count.

Weights held by several stages (tied embedding/output, an embedding shared by encoder and decoder) are
separate copies; after every step their gradient *increments* are summed over the holders, so the copies
receive identical gradients and stay identical under any optimizer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from meshformer.batch import Batch, model_inputs
from meshformer.loss.cross_entropy import LossFn, count_tokens
from meshformer.loss.fused import HeadLoss
from meshformer.loss.layer_terms import bind_layer_terms
from meshformer.loss.objective import Loss
from meshformer.model import Transformer
from meshformer.model.attention import logits_not_recorded
from meshformer.model.moe import MoEFeedForward, loads_not_counted
from meshformer.parallel.grad_norm import local_tensor, settle_grad
from meshformer.parallel.mesh import Meshes
from meshformer.parallel.mesh_model import MultiRankParallelModel, check_sequence_split
from meshformer.parallel.parallel_model import objective_for
from meshformer.parallel.pipeline.sharded_stage import ShardedMicrobatchStage
from meshformer.parallel.pipeline.stages import StageSpan, TransformerStage, stage_pieces
from meshformer.parallel.pipeline.weight_pass import RetainedWeightGraphStage
from meshformer.parallel_dims import ZERO_BUBBLE

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
_CACHE_SIZE = 4  # schedules kept per batch shape: pipelining fixes activation shapes per stage object
_HEADER = 64  # int64 slots describing the tensors of one forward-only P2P message
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


class PipelineParallelModel(MultiRankParallelModel):
    def __init__(
        self,
        stages: list[TransformerStage],
        loss: Loss | LossFn,
        device: torch.device,
        meshes: Meshes,
        *,
        schedule: str,
        n_microbatches: int,
        stage_to_rank: dict[int, int],
        shared: dict[str, list[int]],
        timeout: timedelta | None = None,
        autocast_dtype: torch.dtype | None = None,
        head_loss: HeadLoss | None = None,
        report: dict[str, str] | None = None,
        unsharded_microbatches: bool = False,
    ) -> None:
        if not isinstance(loss, Loss):  # the objective of the last stage, which holds the loss's inputs
            loss = objective_for(stages[-1], loss, head_loss)
        super().__init__(stages[0], loss, device, meshes, autocast_dtype=autocast_dtype, report=report)
        for stage in stages:
            stage.loss = self.loss if stage.is_last else None
        bind_layer_terms(stages, self.loss.layer_weights)  # every stage's layers, not only the first's
        self.stages, self.schedule_name, self.n_microbatches = stages, schedule, n_microbatches
        # FSDP stages: keep parameters and gradients whole across microbatches (torch's way; pipeline_stage.py)
        self.unsharded_microbatches = unsharded_microbatches
        self._has_last = any(s.is_last for s in stages)
        self._records: list[torch.Tensor] = []
        self._mtp_records: list[torch.Tensor] = []  # each microbatch's modules' summed losses (multi-token prediction)
        self._tokens: torch.Tensor | None = None
        self._schedules: OrderedDict[tuple, object] = OrderedDict()
        self._shared = _SharedWeights(stages, shared, stage_to_rank, meshes, timeout)
        self._stage_to_rank, self.n_stages = stage_to_rank, stages[0].span.n_stages

    @property
    def model_parts(self) -> list[nn.Module]:
        return list(self.stages)

    @property
    def reports_loss(self) -> bool:
        return self._has_last

    # ------------------------------------------------------------------ schedule

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self._tokens is not None and self.mtp_depth:
            # the last stage's summed losses: the main one, then each multi-token prediction module's
            self._records.append(output[0].detach().float())
            self._mtp_records.append(output[1:].detach().float())
            return self.mtp_objective(output[0], output[1:]) / self._tokens
        # With a fused head loss the last stage's output already is the summed loss.
        loss_sum = self.loss.token_sum(output, target)
        self._records.append(loss_sum.detach().float())
        if self._tokens is None:  # evaluation: nothing to differentiate
            return loss_sum
        return loss_sum / self._tokens

    def _schedule(self, batch: Batch):
        key = tuple((k, tuple(v.shape)) for k, v in sorted(batch.items()))
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        group = self.meshes.pp.get_group()
        stage_cls = PipelineStage if self.unsharded_microbatches else ShardedMicrobatchStage
        pipeline_stages = [self._stage_class(stage, stage_cls)(stage, stage.span.index, stage.span.n_stages,
                                                               self.device, group=group)
                           for stage in self.stages]
        for pipeline_stage in pipeline_stages:
            _shape_inference_uncounted(pipeline_stage, self.moe_layers)
        cls = SCHEDULES[self.schedule_name]
        first = pipeline_stages[0] if cls in (ScheduleGPipe, Schedule1F1B) else pipeline_stages
        schedule = cls(first, n_microbatches=self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        self._schedules[key] = schedule
        while len(self._schedules) > _CACHE_SIZE:
            self._schedules.popitem(last=False)
        return schedule

    def _stage_class(self, stage: nn.Module, default: type[PipelineStage]) -> type[PipelineStage]:
        split_backward = self.schedule_name in ZERO_BUBBLE
        return RetainedWeightGraphStage if split_backward and stage.is_last and self.mtp_depth else default

    def _train_step(self, batch: Batch) -> torch.Tensor:
        check_sequence_split(batch, self.dims.tp)
        schedule = self._schedule(batch)
        self._records.clear()
        self._mtp_records.clear()
        with self._autocast():
            schedule.step(**_stage_inputs(batch), target=batch["labels"], return_outputs=False)
        if not self._has_last:
            return torch.zeros((), device=self.device)
        # Shape inference on a new schedule also calls the loss once: keep the last n_microbatches records.
        if self._mtp_records:
            self.record_mtp_sums(torch.stack(self._mtp_records[-self.n_microbatches:]).sum(0))
        return torch.stack(self._records[-self.n_microbatches:]).sum()

    def _forward_only(self, batch: Batch, loss: Loss) -> torch.Tensor:
        """Evaluation: every microbatch through the stages in order with blocking P2P, no schedule.

        torch 2.13's schedule.eval() runs backward actions under the zero-bubble runtime (ZBV fails with
        "can't steal_bwd_input"), and evaluation needs no overlap, so this simple loop serves every schedule.
        """
        check_sequence_split(batch, self.dims.tp)
        inputs = _stage_inputs(batch)
        n_chunks = min(self.n_microbatches, batch["labels"].shape[0])  # a short last eval batch: no empty chunks
        chunks = [dict(zip(inputs, parts)) for parts in
                  zip(*(torch.tensor_split(v, n_chunks) for v in inputs.values()))]
        local = {stage.span.index: stage for stage in self.stages}
        me, group = self.meshes.pp_rank, self.meshes.pp.get_group()
        total = torch.zeros((), device=self.device)
        with self._autocast():
            for kwargs in chunks:
                carry: tuple[torch.Tensor, ...] = ()
                for index in range(self.n_stages):
                    if self._stage_to_rank[index] != me:
                        continue
                    if index > 0 and self._stage_to_rank[index - 1] != me:
                        carry = recv_tensors(self._stage_to_rank[index - 1], group, self.device)
                    if index == self.n_stages - 1:  # the evaluated objective (downstream scoring: per-row losses)
                        out = local[index](*carry, loss=loss, **kwargs)
                        total += loss.token_sum(out, kwargs["labels"]).float()
                        continue
                    out = local[index](*carry, **kwargs)
                    carry = out if isinstance(out, tuple) else (out,)
                    if self._stage_to_rank[index + 1] != me:
                        send_tensors(carry, self._stage_to_rank[index + 1], group)
        return total

    # ------------------------------------------------------------------ contract

    @property
    def forwards_per_micro_batch(self) -> int:
        return self.n_microbatches

    def forward_backward(self, batch: Batch, global_tokens: torch.Tensor, last_micro_batch: bool = True
                         ) -> torch.Tensor:
        self._all_reduce_replicas_after(last_micro_batch)
        self._tokens = global_tokens
        self._shared.stash()
        try:
            loss_sum = self._train_step(self._local(batch, training=True))
        finally:
            self._tokens = None
        self._shared.sync()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, batch: Batch, loss: Loss | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self._local(batch)
        loss_sum = self._forward_only(batch, loss or self.loss)
        if not self._logging_representative:
            loss_sum = torch.zeros_like(loss_sum)
        dist.all_reduce(loss_sum)  # the last stages hold the loss; every rank returns it
        return loss_sum, self._token_sum(count_tokens(batch["labels"]).to(self.device))

    def _counts_in_norm(self, part: nn.Module, param: nn.Parameter) -> bool:
        return self._shared.counts_in_norm(param)


def _shape_inference_uncounted(stage: PipelineStage, layers: list[MoEFeedForward]) -> None:
    """torch's stages infer shapes with one real forward (grad enabled, placeholder inputs) on the first step; MoE
    layers must not count its tokens as load, nor attention layers record its logits for MuonClip (the method's name
    differs between torch releases)."""
    for name in ("_forward_metadata_inference", "_shape_inference"):
        original = getattr(stage, name, None)
        if original is None:
            continue

        def uncounted(*args, original=original, **kwargs):
            with loads_not_counted(layers), logits_not_recorded(stage.submod.modules()):
                return original(*args, **kwargs)

        setattr(stage, name, uncounted)


def _stage_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Keyword inputs of every stage: the model inputs and the labels (used by a last stage with a head loss),
    and in training with multi-token prediction the modules' ids and targets (used by the last stage)."""
    ahead: dict[str, torch.Tensor] = {key: batch[key] for key in ("mtp_ahead_ids", "mtp_ahead_labels") if key in batch}
    return {**model_inputs(batch), "labels": batch["labels"], **ahead}


class _SharedWeights:
    """Copies of one weight on several stages (tied embeddings): sum their gradient increments."""

    def __init__(self, stages: list[TransformerStage], shared: dict[str, list[int]], stage_to_rank: dict[int, int],
                 meshes: Meshes, timeout: timedelta | None = None) -> None:
        self.local: dict[str, list[nn.Parameter]] = {}
        self.primary: set[int] = set()  # id of the copy that counts in the global norm
        self.shared_ids: set[int] = set()
        self.groups: dict[str, dist.ProcessGroup | None] = {}
        for stage in stages:
            for local_name, param in stage.named_parameters():
                name = stage.canonical_name(local_name)
                if name in shared:
                    self.local.setdefault(name, []).append(param)
                    self.shared_ids.add(id(param))
                    if stage.span.index == shared[name][0]:
                        self.primary.add(id(param))
        self.groups = _holder_groups(shared, stage_to_rank, meshes, timeout)
        self._stashed: dict[str, torch.Tensor | None] = {}

    def counts_in_norm(self, param: nn.Parameter) -> bool:
        return id(param) not in self.shared_ids or id(param) in self.primary

    def stash(self) -> None:
        for name, params in self.local.items():
            settle_grad(params[0])
            grad = params[0].grad
            self._stashed[name] = None if grad is None else local_tensor(grad).detach().clone()

    @torch.no_grad()
    def sync(self) -> None:
        for name, params in self.local.items():
            if not params[0].requires_grad:  # frozen (a DSA warm-up) on every stage: no gradient to sum
                continue
            before = self._stashed.get(name)
            delta = None
            for param in params:
                if param.grad is None:
                    continue
                settle_grad(param)
                grad = local_tensor(param.grad)
                step = grad - before if before is not None else grad.clone()
                delta = step if delta is None else delta + step
            if delta is None:
                delta = torch.zeros_like(local_tensor(params[0]))
            group = self.groups.get(name)
            if group is not None:
                dist.all_reduce(delta, group=group)
            for param in params:
                if param.grad is None:
                    raise RuntimeError(f"shared weight {name} has no gradient on one of its stages")
                grad = local_tensor(param.grad)
                grad.copy_(delta if before is None else before + delta)


def shared_weights(model: Transformer, spans: list[StageSpan]) -> dict[str, list[int]]:
    """Canonical names of parameters needed by more than one stage -> the stages holding them (sorted)."""
    holders: dict[str, list[int]] = {}
    for span in spans:
        seen: set[str] = set()
        for piece_name, piece in stage_pieces(model, span).items():
            if piece is None:
                continue
            for name, _ in piece.named_parameters(prefix=piece_name, remove_duplicate=False):
                seen.add(model.canonical_name(name))
        for name in seen:
            holders.setdefault(name, []).append(span.index)
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


def _holder_groups(shared: dict[str, list[int]], stage_to_rank: dict[int, int], meshes: Meshes,
                   timeout: timedelta | None = None) -> dict[str, dist.ProcessGroup | None]:
    """A process group over the pipeline ranks holding each shared weight, one per coordinate of the other mesh
    dimensions (dp_replicate, dp_shard, cp, tp).

    Every rank creates every group in the same order (new_group is collective); None when one rank holds
    all the copies (then the increments are summed locally).
    """
    pp = meshes.dims.pp
    rank_sets = {name: tuple(sorted({stage_to_rank[s] for s in stages})) for name, stages in shared.items()}
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    world = meshes.world.mesh  # (pp, dp_replicate, dp_shard, cp, tp) tensor of global ranks
    me = dist.get_rank()
    for ranks in sorted(set(rank_sets.values())):
        if len(ranks) == 1:
            groups[ranks] = None
        elif len(ranks) == pp:
            groups[ranks] = meshes.pp.get_group()
        else:
            for coord in itertools.product(*(range(n) for n in world.shape[1:])):
                members = [int(world[(r, *coord)]) for r in ranks]
                group = dist.new_group(members, timeout=timeout)  # None would mean torch's 30 minutes
                if me in members:
                    groups[ranks] = group
    return {name: groups.get(ranks) for name, ranks in rank_sets.items()}


def send_tensors(tensors: tuple[torch.Tensor, ...], pp_rank: int, group: dist.ProcessGroup) -> None:
    """Send a tuple of tensors: a fixed-size header (count, dtype, shape of each), then the tensors."""
    header = [len(tensors)]
    for t in tensors:
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    dst = dist.get_global_rank(group, pp_rank)
    device = tensors[0].device
    dist.send(torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=device), dst,
              group=group)
    for t in tensors:
        dist.send(t.contiguous(), dst, group=group)


def recv_tensors(pp_rank: int, group: dist.ProcessGroup, device: torch.device) -> tuple[torch.Tensor, ...]:
    src = dist.get_global_rank(group, pp_rank)
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    values, pos, out = header.tolist(), 1, []
    for _ in range(values[0]):
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        shape = values[pos + 2:pos + 2 + ndim]
        pos += 2 + ndim
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src, group=group)
        out.append(t)
    return tuple(out)
