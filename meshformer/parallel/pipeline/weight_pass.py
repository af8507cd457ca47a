"""A pipeline stage whose deferred weight pass (zero-bubble schedules) keeps the autograd graph until it ends.

torch's split backward runs the weight gradients group by group from tensors the input pass saved, freeing the
graph behind each group. On the last stage with multi-token prediction, the received hidden state and the stage's
own embedding of the tokens ahead meet in each module's concatenation, and more than one group walks back through
that join: freeing after the first walk fails the second ("backward through the graph a second time"). Keeping the
graph costs nothing after the pass: it is released with the stage's references to that microbatch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch.distributed.pipelining.stage as torch_stage
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward_weight


@contextlib.contextmanager
def _weight_pass_retaining_graph() -> Iterator[None]:
    # torch's stage calls its module-level stage_backward_weight without a retain_graph argument
    torch_stage.stage_backward_weight = functools.partial(stage_backward_weight, retain_graph=True)
    try:
        yield
    finally:
        torch_stage.stage_backward_weight = stage_backward_weight


class RetainedWeightGraphStage(PipelineStage):
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False
                                   ) -> tuple[tuple[Any, ...], list[dict[str, Any]] | None]:
        if backward_type != "weight":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with _weight_pass_retaining_graph():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
