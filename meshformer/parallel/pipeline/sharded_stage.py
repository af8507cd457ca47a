"""A pipeline stage whose FSDP blocks stay sharded between microbatches.

torch's `PipelineStage` turns off FSDP's resharding and gradient reduction for every microbatch's backward and
reduces once per step: each rank then holds its stage's parameters and gradients *unsharded* for the whole
step (docs/benchmarks/parallel.md, `bench/scale_memory.py`: PP2 x FSDP4). For a 70B model at PP8 that is an
extra 2 x 8.75B parameters per GPU, which does not fit. So by default each microbatch's backward reshards its blocks and
reduce-scatters their gradients, which FSDP accumulates sharded; the price is one more all-gather and
reduce-scatter per block and microbatch. `parallel.pp_fsdp_unsharded_microbatches = true` keeps torch's
behaviour (less communication, for stages that fit whole).

Zero-bubble schedules split backward into an input and a deferred weight pass that reads the unsharded
weights, so they always keep torch's behaviour.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward


class ShardedMicrobatchStage(PipelineStage):
    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False
                                   ) -> tuple[tuple[Any, ...], list[dict[str, Any]] | None]:
        if not isinstance(self.submod, FSDPModule) or backward_type != "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        # As torch does, the step's last reduction waits for perform_reduce_grad (set_is_last_backward(True)
        # there); unlike torch, every backward reshards and reduce-scatters.
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None
