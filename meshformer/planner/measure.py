"""Measured peak memory of one real training step, to hold the planner's predictions against.

"Measured" means live tensor bytes, not RSS: `LiveTensorBytes` (a dispatch mode that also sees storage
resizes, which FSDP2 uses to free and re-allocate unsharded weights) follows every tensor storage created
during the step, plus the parameters, gradients and optimizer state alive when it starts, and records the
highest total. That is the quantity the planner predicts; the allocator's caching, fragmentation and the
Python runtime are excluded. (torch's `MemTracker` does the same but refuses modules called more than once
per step, as pipeline microbatches are.)

For mixture-of-experts models it also reports the routing the step saw: the rows this rank's experts received
over the N k token-slots the rank sent, over the step's MoE layer forwards (`moe_imbalance`, the planner's input of
the same name; 1.0 without experts).

The step is the trainer's: `forward_backward` of one micro-batch, gradient clipping, AdamW, `zero_grad`,
measured on the second step (the first creates the optimizer state).

`saved_activation_bytes` measures one forward's share of that: what its autograd graph keeps for backward, the
quantity the block kinds' `saved_bytes` declare.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial, wraps

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from meshformer.config import Config
from meshformer.model import Transformer
from meshformer.model.moe import moe_layers
from meshformer.parallel import parallelize
from meshformer.parallel.parallelize import world_size
from meshformer.parallel_dims import ParallelDims
from meshformer.train.loss_choice import resolve_loss
from meshformer.train.step import TrainStep


def saved_activation_bytes(module: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes the autograd graph of `forward()` keeps for backward: each saved storage once, `module`'s parameters
    excluded (saved-tensor hooks)."""
    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(kept.values())


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages while active (weakly referenced, so freeing is seen at once)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self.live = self.peak = 0
        for tensor in existing:
            self._track(tensor)

    def _track(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if isinstance(tensor, FakeTensor) or tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._sizes and self._refs[key]() is storage:
            return
        self._sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, partial(self._forget, key))
        self._add(self._sizes[key])

    def _forget(self, key: int, _collected: object = None) -> None:
        self._refs.pop(key, None)
        self._add(-self._sizes.pop(key, 0))

    def _add(self, delta: int) -> None:
        self.live += delta
        self.peak = max(self.peak, self.live)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes and self._refs[key]() is storage:
            old, self._sizes[key] = self._sizes[key], storage.nbytes()
            self._add(self._sizes[key] - old)

    def __enter__(self):
        original = self._original_resize = torch.UntypedStorage.resize_

        @wraps(original)
        def resize_(storage: torch.UntypedStorage, size: int):
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor lower to plain tensor ops, which are what allocate
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


def synthetic_batch(cfg: Config, dp_rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """This data-parallel rank's micro-batch of random tokens (decoder / encoder: ids and labels)."""
    g = torch.Generator().manual_seed(seed + dp_rank)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1), generator=g)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    if cfg.model.attention.document_mask:  # eight documents a row
        batch["doc_ids"] = (torch.arange(cfg.data.seq_len) * 8 // cfg.data.seq_len).expand(cfg.data.batch_size, -1)
    return batch


class TrainingStep:
    """The trainer's step (`TrainStep`) on a fixed synthetic micro-batch."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        torch.manual_seed(cfg.train.seed)
        dims = ParallelDims.from_config(cfg.parallel, world_size())
        self.parallel_model = parallelize(Transformer(cfg.model), cfg, device, resolve_loss(cfg, dims, device.type))
        self.training_step = TrainStep(self.parallel_model, cfg.optim, cfg.schedule, cfg.train.steps, cfg.model.d_model)
        self.optimizer = self.training_step.optimizer
        self.batch = {k: v.to(device) for k, v in synthetic_batch(cfg, self.parallel_model.dp_rank).items()}

    def __call__(self) -> None:
        self.training_step.step([self.batch])

    def state_tensors(self) -> list[torch.Tensor]:
        """Weights, buffers and optimizer state: what lives across steps."""
        out = [t for part in self.parallel_model.model_parts for t in [*part.parameters(), *part.buffers()]]
        return out + [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]


class RoutedRows:
    """Rows each MoE layer forward sends (N k) and its experts receive (after any expert-parallel dispatch)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.sent: list[int] = []
        self.received: list[int] = []
        for part in parts:
            for _, layer in moe_layers(part):
                k = layer.cfg.moe.experts_per_token
                layer.register_forward_pre_hook(
                    lambda mod, args, k=k: self.sent.append(args[0].numel() // args[0].shape[-1] * k))
                # registered after the dispatch hook, so it sees the rows this rank's experts run
                layer.experts.register_forward_pre_hook(lambda mod, args: self.received.append(args[0].shape[0]))

    def imbalance(self) -> float:
        """Received over sent rows, over the step's MoE forwards (the load its saved activations hold)."""
        return sum(self.received) / sum(self.sent) if sum(self.sent) else 1.0


def measure_step_peak(cfg: Config) -> dict[str, float]:
    """Peak live tensor bytes of this rank over its second training step under `cfg.parallel` (CPU), and the
    routing imbalance the step saw (`RoutedRows.imbalance`)."""
    step = TrainingStep(cfg, torch.device("cpu"))
    step()  # the first step creates the optimizer state
    rows = RoutedRows(step.parallel_model.model_parts)
    tracker = LiveTensorBytes(*step.state_tensors())
    start = tracker.live
    with tracker:
        step()
    if dist.is_initialized():
        dist.barrier()
    return {"start": start, "peak": tracker.peak, "moe_imbalance": rows.imbalance()}
