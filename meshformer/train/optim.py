"""What the training step needs around its optimizer (meshformer/optim/ builds it): skipped-update accounting,
AMP's fused-AdamW hook, and learning-rate schedules."""

from __future__ import annotations

import math

import torch

from meshformer.config import ScheduleConfig
from meshformer.errors import DivergenceError


def is_fused_adam(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` is torch's fused Adam/AdamW kernel, which reads AMP loss scaling's two tensors: it
    divides every gradient by `optimizer.grad_scale` and skips the whole update where `optimizer.found_inf` is 1."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        group.get("fused") for group in optimizer.param_groups)


class SkippedUpdates:
    """The count of optimizer steps skipped because the global gradient norm was inf/nan (a bf16 or FP8 overflow, a
    corrupt batch; `meshformer.train.step.TrainStep` skips them). The run stops with one line once more than `limit`
    such steps come in a row (checked when the trainer logs, so recording costs no host sync).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0  # skipped steps counted by `check`
        # On the gradients' device, read by `check` only: skipped since the last check, and the current streak.
        self._skipped: torch.Tensor | None = None
        self._in_a_row: torch.Tensor | None = None

    def record(self, skipped: torch.Tensor) -> None:
        """One step: `skipped` is 1.0 where its update was skipped, else 0.0 (a scalar tensor)."""
        if self._skipped is None or self._in_a_row is None:
            self._skipped, self._in_a_row = torch.zeros_like(skipped), torch.zeros_like(skipped)
        self._skipped += skipped
        self._in_a_row = (self._in_a_row + 1) * skipped

    def check(self, step: int) -> int:
        """The number of steps skipped since the last check (one host read); raises once too many came in a row."""
        if self._skipped is None or self._in_a_row is None:
            return 0
        skipped, in_a_row = (int(v) for v in torch.stack([self._skipped, self._in_a_row]).tolist())
        self._skipped.zero_()
        self.total += skipped
        if in_a_row > self.limit:
            raise DivergenceError(
                f"the last {in_a_row} steps (up to step {step}) all had an inf/nan gradient norm, so none updated the "
                f"weights (optim.max_nonfinite_in_a_row={self.limit})",
                "lower optim.lr or raise schedule.warmup_steps, check the data for corrupt samples, or resume from "
                "the last checkpoint")
        return skipped


def lr_multiplier(step: int, cfg: ScheduleConfig, total_steps: int, d_model: int) -> float:
    """Factor applied to optim.lr at optimizer step `step` (0-based)."""
    warmup = cfg.warmup_steps
    if cfg.name == "noam":  # Vaswani et al.: d^-0.5 * min(s^-0.5, s * warmup^-1.5), s counted from 1
        s = step + 1
        return d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: warmup, stable at the peak, then a linear decay over the last `decay_fraction` of the run
    decay_start = int(total_steps * (1 - cfg.decay_fraction))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return 1.0 - (1.0 - floor) * progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, total_steps: int, d_model: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, total_steps, d_model)
    )


def __getattr__(name: str) -> object:
    """`build_optimizer` moved to meshformer.optim (the optimizer registry): the old import works and warns once."""
    if name == "build_optimizer":
        import warnings

        from meshformer import optim

        warnings.warn("meshformer.train.optim.build_optimizer is deprecated and will be removed in 0.3: use "
                      "meshformer.optim.build_optimizer", FutureWarning, stacklevel=2)
        return optim.build_optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
