"""MuonClip's QK-clip (Kimi K2): after each optimizer step, scale down the query and key projections of every
attention head whose largest logit in the step exceeded the threshold tau, so that its logits stay bounded.

Each `Attention` records, in its training forwards, the largest logit S_h = max q_h·k·scale of each query head h
(model/attention.py: `max_logit`, from the scores the blockwise and math paths hold anyway). After the step, with
gamma_h = tau / S_h for the heads where S_h > tau (Kimi K2's per-head rule):
- a head with its own key head (multi-head attention): query rows and key rows of h each times sqrt(gamma_h);
- grouped-query attention, where one key head serves several query heads: the query rows of h times gamma_h and
  the shared key left as it is. This is Kimi K2's rule for MLA's shared rotary key (head-specific parts carry the
  whole factor, the shared part is untouched so that no other head's logits change), applied to the whole key.
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

from meshformer.model.attention import Attention
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
    """A q_proj or k_proj: its weight and bias with each local row's head."""

    def __init__(self, linear: nn.Linear, head_dim: int) -> None:
        self.params = [p for p in (linear.weight, linear.bias) if p is not None]
        self.heads = [_global_rows(p) // head_dim for p in self.params]

    def scale_(self, factor: torch.Tensor) -> None:
        """Multiply each head's rows by `factor` (one value per head of the whole projection)."""
        for param, heads in zip(self.params, self.heads, strict=True):
            local = local_tensor(param)  # under no_grad: in place on the parameter
            local.mul_(factor[heads].to(local.dtype).view(-1, *[1] * (local.ndim - 1)))


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
        self.layers: list[Attention] = []
        self._queries: list[_Projection] = []
        self._keys: list[_Projection | None] = []  # None: grouped-query (the shared key stays)
        self._heads: list[tuple[int, int, int]] = []  # (heads of the whole layer, first and count of this rank's)
        seen: set[int] = set()
        for part in model_parts:
            for module in part.modules():
                if not isinstance(module, Attention) or id(module) in seen:
                    continue
                seen.add(id(module))
                head_dim = module.head_dim
                n_heads = module.q_proj.weight.shape[0] // head_dim  # the whole layer's (DTensor shapes are global)
                kv_heads = module.k_proj.weight.shape[0] // head_dim
                local = n_heads // tp_size
                module.record_max_logit = True
                module.max_logit.fill_(float("-inf"))  # also clears what a meta-device init left there
                self.layers.append(module)
                self._queries.append(_Projection(module.q_proj, head_dim))
                self._keys.append(_Projection(module.k_proj, head_dim) if kv_heads == n_heads else None)
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
        for i, (queries, keys, (n_heads, _, _)) in enumerate(zip(self._queries, self._keys, self._heads,
                                                                  strict=True)):
            layer_gamma = gamma[i, :n_heads]
            if keys is None:
                queries.scale_(layer_gamma)
            else:
                root = layer_gamma.sqrt()
                queries.scale_(root)
                keys.scale_(root)
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
