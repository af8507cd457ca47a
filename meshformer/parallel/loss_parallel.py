"""Vocabulary-parallel cross-entropy: label smoothing and z-loss on logits sharded over tensor-parallel ranks.

torch's `loss_parallel` rejects label smoothing, so this is the Megatron formulation: each rank holds the
logits of its vocabulary rows; two all-reduces (max, then the stacked sums) give the log-partition function,
the target logit and the smoothing term without ever materialising full-vocabulary logits. The result equals
`meshformer.loss.cross_entropy_sum` on the gathered logits (summed, IGNORE_INDEX skipped, fp32 math).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX
from meshformer.parallel.plan import LossFn


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group, vocab_start, vocab_size, label_smoothing, z_loss):
        local_vocab = logits.shape[-1]
        x = logits.reshape(-1, local_vocab).float()
        y = labels.reshape(-1)
        valid = y != IGNORE_INDEX
        in_shard = valid & (y >= vocab_start) & (y < vocab_start + local_vocab)
        index = (y - vocab_start).clamp(0, local_vocab - 1)

        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max[:, None]
        exp = shifted.exp()
        # One all-reduce for the three per-token sums: partition function, target logit, sum of logits.
        sums = torch.stack([
            exp.sum(dim=-1),
            shifted.gather(1, index[:, None]).squeeze(1) * in_shard,
            shifted.sum(dim=-1) if label_smoothing > 0 else torch.zeros_like(row_max),
        ])
        dist.all_reduce(sums, group=group)
        partition, target, logit_sum = sums
        log_partition = partition.log()
        per_token = (1.0 - label_smoothing) * (log_partition - target)
        if label_smoothing > 0:  # smoothing term: mean over the vocabulary of -log p
            per_token = per_token + label_smoothing * (log_partition - logit_sum / vocab_size)
        lse = log_partition + row_max
        if z_loss > 0:
            per_token = per_token + z_loss * lse.square()
        loss = (per_token * valid).sum()

        ctx.save_for_backward(exp, partition, lse, index, in_shard, valid)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        ctx.label_smoothing, ctx.z_loss, ctx.vocab_size = label_smoothing, z_loss, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        exp, partition, lse, index, in_shard, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        probs = exp / partition[:, None]
        scale = 1.0 + 2.0 * ctx.z_loss * lse if ctx.z_loss > 0 else torch.ones_like(lse)
        grad = probs * scale[:, None]
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, index] -= (1.0 - eps) * in_shard.to(grad.dtype)
        if eps > 0:
            grad -= eps / ctx.vocab_size
        grad *= (valid.to(grad.dtype) * grad_loss)[:, None]
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None, None


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
    return _VocabParallelCrossEntropy.apply(logits, labels, group, vocab_start, vocab_size, label_smoothing, z_loss)


def vocab_parallel_loss_fn(
    group: dist.ProcessGroup, vocab_start: int, vocab_size: int, label_smoothing: float, z_loss: float
) -> LossFn:
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, labels, group=group, vocab_start=vocab_start,
                                            vocab_size=vocab_size, label_smoothing=label_smoothing, z_loss=z_loss)

    return loss_fn
