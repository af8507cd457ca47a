"""Vocabulary-parallel cross-entropy: label smoothing and z-loss on logits sharded over tensor-parallel ranks.

torch's `loss_parallel` rejects label smoothing, so this is the Megatron formulation: each rank holds the
logits of its vocabulary rows; two all-reduces (max, then the stacked sums) give the log-partition function,
the target logit and the smoothing term without ever materialising full-vocabulary logits. The statistics and
the gradient are the chunked head loss's (`meshformer.loss.fused`), applied here to logits the model returned.
The result equals `cross_entropy_sum` (meshformer.loss.cross_entropy) on the gathered logits (summed,
IGNORE_INDEX skipped, fp32 math).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import VocabShard, logits_grad_, token_losses, vocab_statistics


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, shard, label_smoothing, z_loss):
        x = logits.reshape(-1, logits.shape[-1]).float()
        valid = labels.reshape(-1) != IGNORE_INDEX
        lse, target, total, index, here = vocab_statistics(x, labels.reshape(-1), valid, shard, label_smoothing > 0)
        loss = (token_losses(lse, target, total, shard.total, label_smoothing, z_loss) * valid).sum()
        ctx.save_for_backward(x, lse, index, here, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        ctx.label_smoothing, ctx.z_loss, ctx.vocab_size = label_smoothing, z_loss, shard.total
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, lse, index, here, valid = ctx.saved_tensors
        # x may be the logits themselves (fp32): the in-place gradient works on a copy
        grad = logits_grad_(x.clone(), lse, index, here, valid, ctx.vocab_size, ctx.label_smoothing, ctx.z_loss)
        grad.mul_(grad_loss)
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    vocab_start: int,
    vocab_size: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """Summed token loss from this rank's logits shard (..., vocab_size / tp); identical on every tp rank."""
    shard = VocabShard(group, vocab_start, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits, labels, shard, label_smoothing, z_loss)


def vocab_parallel_loss_fn(shard: VocabShard, label_smoothing: float, z_loss: float) -> LossFn:
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, group=shard.group, vocab_start=shard.start,
                                            vocab_size=shard.total, label_smoothing=label_smoothing, z_loss=z_loss)

    return loss_fn
