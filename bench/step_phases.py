"""Wall time of each phase of a training step (data, forward, head + loss, backward, clip, optimizer, ...).

Used by bench/profile_step.py for both sides. The phases are marked from outside the step, by wrapping the
callables each side already calls (bound methods and module hooks), so neither the Trainer nor the reference
carries benchmark code. CPU ops run synchronously, so wall time between two marks is that phase's time
(on CUDA the marks would need synchronising and are not used).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class PhaseClock:
    """Accumulates, per phase name, the time since the previous mark (wall, or this process's CPU time)."""

    def __init__(self, clock: str = "wall") -> None:
        self.read = time.process_time if clock == "cpu" else time.perf_counter
        self.totals: dict[str, float] = defaultdict(float)
        self.last = self.read()
        self.steps = 0

    def mark(self, phase: str) -> None:
        now = self.read()
        self.totals[phase] += now - self.last
        self.last = now

    def ms_per_step(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {k: round(v * 1e3 / steps, 2) for k, v in self.totals.items()}


def around(clock: PhaseClock, fn: Callable, before: str | None, after: str | None) -> Callable:
    """`fn` marking `before` (the phase that ends as it starts) and `after` (the phase it is) around its call."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            clock.mark(before)
        out = fn(*args, **kwargs)
        if after:
            clock.mark(after)
        return out

    return wrapped


class _TimedIterator:
    def __init__(self, clock: PhaseClock, inner: Iterator) -> None:
        self.clock, self.inner = clock, inner

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        self.clock.mark("bookkeeping")
        batch = next(self.inner)
        self.clock.mark("data")
        return batch


def _wrap_optimizer(clock: PhaseClock, optimizer: torch.optim.Optimizer) -> None:
    optimizer.step = around(clock, optimizer.step, "scheduler/misc", "optimizer")  # type: ignore[method-assign]
    optimizer.zero_grad = around(clock, optimizer.zero_grad, "scheduler/misc", "zero_grad")  # type: ignore


def instrument_ours(clock: PhaseClock, ours: Any) -> None:
    """Marks in our Trainer step: data, forward (blocks), head + loss, backward, clip, optimizer, zero_grad."""
    trainer = ours.trainer
    plan, model = trainer.parallel_model, trainer.parallel_model.model
    trainer.train_iter = _TimedIterator(clock, trainer.train_iter)
    plan.model.forward = around(clock, model.forward, "data/setup", None)
    model.head = around(clock, model.head, "forward", "head (+ fused loss)")
    plan.loss_fn = around(clock, plan.loss_fn, None, "loss")
    plan.grad_norm = around(clock, plan.grad_norm, "backward", "clip_grad")
    _wrap_optimizer(clock, trainer.optimizer)


def instrument_reference(clock: PhaseClock, reference: Any) -> None:
    """The same marks in the nanoGPT-style reference step."""
    step = reference.step
    reference.batches.xy = around(clock, reference.batches.xy, "bookkeeping", "data")
    step.forward = around(clock, step.forward, "data/setup", "head (+ fused loss)")
    step.model.lm_head.register_forward_pre_hook(lambda *_: clock.mark("forward"))
    _wrap_optimizer(clock, step.optimizer)


@contextmanager
def reference_clip_marks(clock: PhaseClock):
    """The reference calls torch.nn.utils.clip_grad_norm_ directly: mark around it while it runs."""
    original = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = around(clock, original, "backward", "clip_grad")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.nn.utils.clip_grad_norm_ = original  # type: ignore[assignment]


def phase_breakdown(side: str, runner: Any, steps: int, clock_kind: str = "wall") -> dict[str, float]:
    """Milliseconds per step in each phase over `steps` steps of `runner` (ours or the reference), on CPU."""
    clock = PhaseClock(clock_kind)
    if side == "ours":
        instrument_ours(clock, runner)
        context = contextmanager(lambda: (yield))()
    else:
        instrument_reference(clock, runner)
        context = reference_clip_marks(clock)
    with context:
        for _ in range(steps):
            clock.mark("between steps")
            runner()
            clock.mark("bookkeeping")
            clock.steps += 1
    clock.totals.pop("between steps", None)
    out = clock.ms_per_step()
    out["total"] = round(sum(out.values()), 2)
    return out
