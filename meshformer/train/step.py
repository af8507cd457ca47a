"""`TrainStep`: the one owner of an optimizer step, from micro-batches to updated weights.

It holds the parallelized model (a `ParallelModel` from `parallelize`), builds and owns the optimizer, the learning-
rate schedule and the count of skipped updates, and runs the whole update in one fixed order:

1. forward/backward of every micro-batch (gradients of summed token losses / the step's global token count);
   with fault-tolerant replica groups, then `gradient_sync`: the average over the groups and their commit vote
   (no commit: the step ends here, its gradients dropped);
2. the global gradient norm (every shard, replica and pipeline stage);
3. clipping by it: with torch's fused AdamW the clip factor goes to the kernel as `grad_scale` (it divides each
   gradient by it), saving a pass that reads and writes every gradient; other kernels scale the gradients;
4. the optimizer step, skipped where the norm is inf/nan (fused: the kernel's `found_inf`, no host sync; others
   read the norm on the host), so weights and moments never take a NaN; every rank skips the same steps;
5. the post-step hooks, in the order they were added (QK-clip; FP8 weight-scale refresh; MoE router-bias
   updates), told whether the update was applied: a skipped step leaves the router biases as it leaves the weights;
6. the scheduler and zero_grad.

The optimizer's private attributes (`grad_scale`, `found_inf`) are written here and nowhere else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshformer.batch import Batch
from meshformer.config import OptimConfig, ScheduleConfig
from meshformer.optim import build_optimizer
from meshformer.parallel.float8 import refresh_weight_scales
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.train.optim import SkippedUpdates, build_scheduler, is_fused_adam
from meshformer.train.qk_clip import qk_clip_for

# Runs after each optimizer step (skipped ones too), before the scheduler moves, given `applied`: a scalar tensor on
# the device, 1.0 where the update was applied and 0.0 where it was skipped (read it without a host sync)
PostStepHook = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class StepStats:
    """What one step reports; tensors stay on the device (reading them is a host sync)."""

    loss_sum: torch.Tensor  # summed token loss of this rank's tokens (reduce_for_logging makes it global)
    global_tokens: torch.Tensor  # target tokens of the whole step, every rank and micro-batch
    grad_norm: torch.Tensor  # the global gradient norm before clipping (inf/nan: the update was skipped)
    lr: float  # the learning rate the update used (the scheduler has moved on since)
    committed: bool = True  # False: fault tolerance dropped the update (no optimizer or scheduler step)


class TrainStep:
    """The training step of a run: `step(micro_batches)` runs one whole optimizer update (see the module notes)."""

    def __init__(self, parallel_model: ParallelModel, optim: OptimConfig, schedule: ScheduleConfig, total_steps: int,
                 d_model: int, *, on_phase: Callable[[str], None] | None = None) -> None:
        """`total_steps`, `d_model`: the schedule's length and (noam) scale. `on_phase(name)`: told as each phase
        starts ("forward_backward", "grad_norm", "optimizer"), e.g. for hang reports."""
        self.parallel_model = parallel_model
        self.optimizer, self.kernel = build_optimizer(parallel_model.model_parts, optim)
        self.scheduler = build_scheduler(self.optimizer, schedule, total_steps, d_model)
        self.skipped_updates = SkippedUpdates(optim.max_nonfinite_in_a_row)
        self.grad_clip = optim.grad_clip  # <= 0: no clipping
        self._fused = is_fused_adam(self.optimizer)
        self.clip_in_update = self._fused  # the clip factor as fused AdamW's grad_scale (False: a scaling pass)
        self._on_phase = on_phase or (lambda name: None)
        self._post_step_hooks: list[PostStepHook] = []
        # Fault-tolerant replica groups (train/replica_step.py): given the step's target tokens after backward,
        # averages the gradients across the groups and says whether the update may be applied
        self.gradient_sync: Callable[[torch.Tensor], bool] | None = None
        # MuonClip's QK-clip (optim.qk_clip_threshold), first: attention heads whose largest logit exceeded the
        # threshold get their query/key rows scaled down (train/qk_clip.py) before float8 scales are refreshed
        self.qk_clip = qk_clip_for(parallel_model, optim.qk_clip_threshold) if optim.qk_clip_threshold else None
        if self.qk_clip is not None:
            self.add_post_step_hook(self.qk_clip)
        if parallel_model.float8_weight_gather:
            self.add_post_step_hook(self._refresh_float8_scales)
        if any(layer.cfg.moe.router_bias_update_rate > 0 for layer in parallel_model.moe_layers):
            self.add_post_step_hook(parallel_model.update_expert_bias)

    def qk_clip_scalars(self) -> dict[str, float]:
        """MuonClip's log of the latest step (train/qk_clip.py), {} without it; every rank: a collective under PP."""
        return {} if self.qk_clip is None else self.qk_clip.scalars()

    def add_post_step_hook(self, hook: PostStepHook) -> None:
        """Run `hook(applied)` after every optimizer step, after the hooks added before it (see PostStepHook)."""
        self._post_step_hooks.append(hook)

    def step(self, micro_batches: Sequence[Batch]) -> StepStats:
        """One optimizer step over the micro-batches of this rank (gradient accumulation: several)."""
        parallel_model = self.parallel_model
        self._on_phase("forward_backward")
        parallel_model.begin_step(len(micro_batches))
        global_tokens = parallel_model.global_token_count(list(micro_batches))
        loss_sum = torch.zeros((), device=parallel_model.device)
        last = len(micro_batches) - 1
        for i, batch in enumerate(micro_batches):
            loss_sum += parallel_model.forward_backward(batch, global_tokens, last_micro_batch=i == last)
        if self.gradient_sync is not None and not self.gradient_sync(global_tokens):
            self.optimizer.zero_grad(set_to_none=True)
            return StepStats(loss_sum, global_tokens, torch.full((), math.nan), self.optimizer.param_groups[0]["lr"],
                             committed=False)
        self._on_phase("grad_norm")
        grad_norm = parallel_model.grad_norm()
        self._clip(grad_norm)
        self._on_phase("optimizer")
        lr = self.optimizer.param_groups[0]["lr"]
        applied = self._optimizer_step(grad_norm)
        for hook in self._post_step_hooks:
            hook(applied)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(loss_sum, global_tokens, grad_norm, lr)

    def _clip(self, grad_norm: torch.Tensor) -> None:
        if self.grad_clip <= 0:
            return
        if self.clip_in_update:
            self.optimizer.grad_scale = torch.clamp(  # type: ignore[attr-defined]
                (grad_norm + 1e-6) / self.grad_clip, min=1.0)
        else:
            self.parallel_model.scale_grads_(torch.clamp(self.grad_clip / (grad_norm + 1e-6), max=1.0))

    def _optimizer_step(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """`optimizer.step()` unless `grad_norm` is inf/nan; returns 1.0 where it stepped, 0.0 where it skipped."""
        skipped = (~torch.isfinite(grad_norm)).to(torch.float32)
        if self._fused:
            self.optimizer.found_inf = skipped  # type: ignore[attr-defined]
            self.optimizer.step()
        elif not skipped.item():
            self.optimizer.step()
        self.skipped_updates.record(skipped)
        return 1.0 - skipped

    def _refresh_float8_scales(self, applied: torch.Tensor) -> None:
        # FSDP all-gathers float8 weights: one all-reduce refreshes every weight's scale instead of one per weight.
        refresh_weight_scales(self.parallel_model.model_parts)
