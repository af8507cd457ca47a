"""Token-level cross-entropy with label smoothing and optional z-loss, summed so callers normalise globally.

Returning a sum (and leaving the division to the caller) is what makes gradient accumulation, padding
and data parallelism agree: the loss of a global batch is sum over all its tokens / number of tokens,
however the tokens are split across micro-batches, ranks or pipeline stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshformer.batch import IGNORE_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, labels) -> summed loss


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Sum of per-token losses over positions whose label is not IGNORE_INDEX (fp32 math)."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_labels = labels.reshape(-1)
    loss = F.cross_entropy(
        flat_logits, flat_labels, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing, reduction="sum"
    )
    if z_loss > 0:  # PaLM's auxiliary loss keeps log Z near 0 for stability
        valid = flat_labels != IGNORE_INDEX
        log_z = torch.logsumexp(flat_logits, dim=-1)
        loss = loss + z_loss * (log_z.square() * valid).sum()
    return loss


def count_tokens(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def plain_loss_fn(label_smoothing: float = 0.0, z_loss: float = 0.0) -> LossFn:
    """`cross_entropy_sum` on full-vocabulary logits with these options."""
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels, label_smoothing=label_smoothing, z_loss=z_loss)

    return loss_fn
