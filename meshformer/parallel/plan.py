"""The contract between the trainer and a parallel layout.

The trainer only ever talks to a `TrainingPlan`: it hands over micro-batches and the global count of
target tokens, and gets back gradients that equal d(sum of token losses / global tokens) — the same
gradients a single process computes on the whole global batch. How the model is sharded (FSDP, TP,
PP) is hidden behind this object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from meshformer.batch import Batch, model_inputs
from meshformer.fused_loss import HeadLoss
from meshformer.loss import count_tokens, cross_entropy_sum
from meshformer.parallel.grad_norm import is_fused_adam, scale_grads_

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed loss


class TrainingPlan:
    """Single device: the reference every parallel layout must match."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, device: torch.device, *,
                 autocast_dtype: torch.dtype | None = None, head_loss: HeadLoss | None = None,
                 report: dict[str, str] | None = None) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.dp_rank, self.dp_size = 0, 1  # the data loader's view of this rank
        self.autocast_dtype = autocast_dtype  # None: the model's own dtype (fp32)
        # train.loss: the model computes the loss from its final hidden states, chunked, instead of returning
        # full-vocabulary logits to `loss_fn` (None: the plain path).
        self.head_loss = head_loss
        # How the run is laid out and which kernels run (layout, attention, norms, compile, recompute, FSDP,
        # pipeline, loss), for the run log.
        self.report: dict[str, str] = dict(report or {})

    @property
    def model_parts(self) -> list[nn.Module]:
        """Modules holding this rank's parameters (several with pipeline parallelism)."""
        return [self.model]

    @property
    def supports_generation(self) -> bool:
        """Whether every rank can run the whole model's forward (not so under pipeline parallelism)."""
        return True

    @property
    def reports_loss(self) -> bool:
        """Whether this rank sees the loss (the last pipeline stage does)."""
        return True

    def global_token_count(self, micro_batches: list[Batch]) -> torch.Tensor:
        """Target tokens in the whole step: every micro-batch, every data-parallel rank."""
        return torch.stack([count_tokens(b["labels"]) for b in micro_batches]).sum().to(self.device)

    def forward_backward(self, batch: Batch, global_tokens: torch.Tensor, last_micro_batch: bool = True
                         ) -> torch.Tensor:
        """Accumulate gradients of (summed loss of this micro-batch / global_tokens); return the detached sum.

        `last_micro_batch`: whether the step's gradients are complete after this one (gradient accumulation)."""
        loss_sum = self._loss_sum(batch)
        (loss_sum / global_tokens).backward()
        return loss_sum.detach()

    @torch.no_grad()
    def evaluate(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, token count) of a batch, reduced over data-parallel ranks."""
        return self._loss_sum(batch).float(), count_tokens(batch["labels"])

    def _loss_sum(self, batch: Batch) -> torch.Tensor:
        if self.head_loss is not None:
            with self._autocast():
                return self.model(**model_inputs(batch), labels=batch["labels"], head_loss=self.head_loss)
        with self._autocast():
            logits = self.model(**model_inputs(batch))
        return self.loss_fn(logits, batch["labels"])

    def clip_grad_norm(self, max_norm: float, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
        """Clip by the global gradient norm (over every shard and stage); return the norm before clipping.

        Given a fused Adam/AdamW, the clip factor goes to its kernel (`grad_scale`, which the update divides each
        gradient by) instead of a separate pass that reads and writes every gradient once more.
        """
        norm = self.grad_norm()
        if max_norm <= 0:
            return norm
        if optimizer is not None and is_fused_adam(optimizer):
            optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # type: ignore[attr-defined]
        else:
            self.scale_grads_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm

    def weights_updated(self) -> None:
        """The optimizer has just changed the weights (the trainer calls this after every step)."""

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole gradient."""
        return torch.nn.utils.get_total_norm(self._all_grads(), foreach=True)

    def scale_grads_(self, coef: torch.Tensor) -> None:
        """Multiply every gradient by `coef` (a scalar tensor) in place."""
        scale_grads_(self._all_grads(), coef)

    def _all_grads(self) -> list[torch.Tensor]:
        """Every gradient once, duplicates of shared weights included (under pipelines they are separate tensors)."""
        seen, grads = set(), []
        for part in self.model_parts:
            for param in part.parameters():
                if param.grad is not None and id(param) not in seen:
                    seen.add(id(param))
                    grads.append(param.grad)
        return grads

    def reduce_for_logging(self, value: torch.Tensor) -> float:
        """A per-rank sum made global (identity on one device)."""
        return float(value)

    def _autocast(self) -> torch.autocast:
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def default_loss_fn(label_smoothing: float = 0.0, z_loss: float = 0.0) -> LossFn:
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels, label_smoothing=label_smoothing, z_loss=z_loss)

    return loss_fn
