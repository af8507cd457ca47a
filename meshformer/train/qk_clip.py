"""MuonClip's QK-clip (Kimi K2): after each optimizer step, scale down the query and key projections of every
attention head whose largest logit in the step exceeded the threshold tau, so that its logits stay bounded.

Each attention layer of a kind that declares `qk_clip` (`Attention`, model/attention.py; `MultiHeadLatentAttention`,
model/mla.py) records, in its training forwards, the largest logit S_h = max q_h·k·scale of each query head h
(`max_logit`, from the scores the blockwise and math paths hold anyway). After the step, with gamma_h = tau / S_h
for the heads where S_h > tau, each layer's `qk_clip_rows` says how each row of head h scales (Kimi K2's per-head
rule):
- a head with its own key head (multi-head attention): query rows and key rows of h each times sqrt(gamma_h);
- grouped-query attention, where one key head serves several query heads: the query rows of h times gamma_h and
  the shared key left as it is (MLA's rule for its shared rotary key, applied to the whole key);
- multi-head latent attention: the position-free query rows (q_proj / q_b_proj) and key rows (kv_b_proj) of h times
  sqrt(gamma_h), its rotary query rows times gamma_h, its value rows and the rotary key every head shares
  (kv_a_proj) untouched.
Either way the head's logits scale by gamma_h, its largest to exactly tau, and no other head changes. The
projections' biases scale with their rows (q = W x + b scales as a whole).

Every layout: the per-head maxima are reduced with MAX over the ranks holding other tokens of the step (data and
context parallel) and over tensor-parallel ranks (each holds its own heads; the rest of the vector is -inf), so
every rank of a pipeline stage scales the same heads. Each rank then scales the rows it holds: a weight under
TP/FSDP is a DTensor whose local piece is a set of whole rows, and the global row index of each local row (found
once, `_global_rows`) names its head. Pipeline stages clip their own layers.

A step skipped for an inf/nan gradient norm clips nothing (its weights did not move). QK-norm would undo any
scaling of the projections: config validation refuses the two together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from meshformer.model.attention import ROOT, WHOLE, ClipsLogits
from meshformer.parallel.grad_norm import local_tensor
from meshformer.parallel.parallel_model import ParallelModel


def _global_rows(param: torch.Tensor) -> torch.Tensor:
    """The index in the whole parameter of each row of this rank's piece of it (a local slice of a replicated
    index: no communication)."""
    rows = torch.arange(param.shape[0], device=local_tensor(param).device)
    if not isinstance(param, DTensor):
        return rows
    mesh = param.device_mesh
    whole = DTensor.from_local(rows, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, param.placements).to_local()


class _Projection:
    """A projection whose rows QK-clip scales: its weight and bias with each local row's head and how that row scales
    (KEEP, ROOT or WHOLE, model/attention.py)."""

    def __init__(self, linear: nn.Linear, rows_per_head: int, how: list[int]) -> None:
        self.params = [p for p in (linear.weight, linear.bias) if p is not None]
        rows = [_global_rows(p) for p in self.params]
        self.heads = [r // rows_per_head for r in rows]
        kinds = torch.tensor(how, device=rows[0].device)
        self.kinds = [kinds[r % rows_per_head] for r in rows]
        self.n_heads = linear.weight.shape[0] // rows_per_head  # the whole layer's (DTensor shapes are global)

    def scale_(self, gamma: torch.Tensor) -> None:
        """Multiply each head's rows by 1, sqrt(gamma) or gamma as they say (`gamma`: one value per head of the whole
        projection)."""
        choices = torch.stack([torch.ones_like(gamma), gamma.sqrt(), gamma])  # indexed by KEEP, ROOT, WHOLE
        for param, heads, kinds in zip(self.params, self.heads, self.kinds, strict=True):
            local = local_tensor(param)  # under no_grad: in place on the parameter
            local.mul_(choices[kinds, heads].to(local.dtype).view(-1, *[1] * (local.ndim - 1)))


class QKClip:
    """Post-step hook (`TrainStep.add_post_step_hook`) clipping the attention heads of `model_parts` at `threshold`.
    `groups`: the process groups to reduce the per-head maxima over with MAX (data, context and tensor parallel);
    `tp_rank`, `tp_size`: which heads this rank's attention computes (its tensor-parallel share, in rank order);
    `pp_group`: the pipeline stages, combined for the log."""

    def __init__(self, model_parts: list[nn.Module], threshold: float, *,
                 groups: Sequence[dist.ProcessGroup] = (), tp_rank: int = 0, tp_size: int = 1,
                 pp_group: dist.ProcessGroup | None = None) -> None:
        self.threshold = threshold
        self.groups, self.pp_group = list(groups), pp_group
        self.layers: list[ClipsLogits] = []
        self._projections: list[list[_Projection]] = []  # per layer: the rows it scales (the queries' first)
        self._heads: list[tuple[int, int, int]] = []  # (heads of the whole layer, first and count of this rank's)
        seen: set[int] = set()
        for part in model_parts:
            for module in part.modules():
                if not isinstance(module, ClipsLogits) or id(module) in seen:
                    continue
                seen.add(id(module))
                projections = [_Projection(linear, rows, how) for linear, rows, how in module.qk_clip_rows()
                               if ROOT in how or WHOLE in how]
                n_heads = projections[0].n_heads
                local = n_heads // tp_size
                module.record_max_logit = True
                module.max_logit.fill_(float("-inf"))  # also clears what a meta-device init left there
                self.layers.append(module)
                self._projections.append(projections)
                self._heads.append((n_heads, tp_rank * local, local))
        self._width = max((n for n, _, _ in self._heads), default=0)
        like = self.layers[0].max_logit if self.layers else torch.zeros(())
        self._dtype = torch.promote_types(like.dtype, torch.float32)  # the factors in at least fp32
        # of the latest step, for the log: the largest logit over this stage's heads, and the heads clipped
        self.last_max_logit = torch.full((), float("-inf"), device=like.device, dtype=self._dtype)
        self.last_clipped = torch.zeros((), device=like.device)

    @torch.no_grad()
    def __call__(self, applied: torch.Tensor) -> None:
        if not self.layers:
            return
        maxima = torch.full((len(self.layers), self._width), float("-inf"), device=self.last_max_logit.device,
                            dtype=self._dtype)
        for i, (layer, (_, first, count)) in enumerate(zip(self.layers, self._heads, strict=True)):
            maxima[i, first:first + count] = layer.max_logit[:count]
            layer.max_logit.fill_(float("-inf"))
        for group in self.groups:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
        clipped = (maxima > self.threshold) & (applied > 0)
        gamma = torch.where(clipped, self.threshold / maxima, torch.ones_like(maxima))
        for i, (projections, (n_heads, _, _)) in enumerate(zip(self._projections, self._heads, strict=True)):
            for projection in projections:
                projection.scale_(gamma[i, :n_heads])
        self.last_max_logit = maxima.max()
        self.last_clipped = clipped.sum().float()

    def scalars(self) -> dict[str, float]:
        """Of the latest step: `optim/max_attention_logit` (over every head) and `optim/qk_clip_heads` (the heads
        clipped); under pipeline parallel a collective over the stages."""
        top, count = self.last_max_logit.clone(), self.last_clipped.clone()
        if self.pp_group is not None:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.pp_group)
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.pp_group)
        top, count = torch.stack([top, count]).tolist()
        return {"optim/max_attention_logit": top if math.isfinite(top) else math.nan,
                "optim/qk_clip_heads": count}


def qk_clip_for(parallel_model: ParallelModel, threshold: float) -> QKClip:
    """The hook for a run's `ParallelModel`: the MAX reduction over the data-, context- and tensor-parallel ranks
    of a pipeline stage (one group), this rank's tensor-parallel share of the heads."""
    meshes = getattr(parallel_model, "meshes", None)
    if meshes is None:  # one process
        return QKClip(parallel_model.model_parts, threshold)
    dims = meshes.dims
    mesh = meshes.moe_tokens if dims.tp_enabled else meshes.tokens  # moe_tokens: data x context x tensor parallel
    groups = [mesh.get_group()] if mesh.size() > 1 else []
    return QKClip(parallel_model.model_parts, threshold, groups=groups, tp_rank=meshes.tp_rank, tp_size=dims.tp,
                  pp_group=meshes.pp.get_group() if dims.pp_enabled else None)
