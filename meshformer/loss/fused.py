"""Output projection + cross-entropy without full-vocabulary logits.

The plain path materialises logits (B·T·V, autocast dtype), upcasts them to fp32 and keeps softmax-sized
buffers for backward: at a 128k vocabulary that is the largest activation in the model. Here the rows are
processed in chunks: each chunk's logits are computed, turned into the loss and the gradient of the loss
w.r.t. those logits, and immediately folded into the gradients of the hidden states, weight and bias
(the approach of Liger's fused linear cross-entropy). Backward then only scales the stored gradients by the
incoming scalar, so peak memory holds one chunk of logits instead of all of them.

Storing costs an fp32 V x D weight gradient (and a hidden-state gradient) per loss between its forward and
backward: 1 GiB at Llama-1B's head. Where a pipeline's last stage runs several micro-batches' forwards before
their backwards (GPipe; interleaved zero-bubble defers weight passes), these pile up, past the plain loss's
logits for small micro-batches. `recompute=True` (train.loss="chunked_recompute", picked by "auto" there: see
`meshformer.train.loss_choice.loss_method`) keeps only each row's fp32 log-partition from the forward and
recomputes each chunk's logits in the backward: one more head GEMM per chunk (more in a zero-bubble split
backward, which recomputes in both its passes), for a lower last-stage peak where micro-batches pile up
(figures: parallel/README.md, bench/pp_head_loss_memory.py). Both paths share the chunk projection, the
logits-gradient maths and its folding into the hidden/weight/bias gradients (`_HeadGradients`).

Same maths as `meshformer.loss.cross_entropy.cross_entropy_sum` (sum over non-ignored tokens, label smoothing,
PaLM z-loss, fp32 softmax); under autocast the projection runs in the autocast dtype like `nn.Linear` does.
Why a hand-derived backward rather than the same chunks through autograd with activation checkpointing (each
chunk's logits recomputed in the backward): `python bench/fused_loss_memory.py` (Llama-1B head ratios scaled down:
2048 rows, D 512, V 32064, fp32, CPU, one thread) gives, against the plain loss, peak memory / time of 0.42x / 1.11x
(stored gradients), 0.42x / 1.55x (recomputed) and 0.59x / 1.71x (autograd, checkpointed): both hand-derived
backwards win on memory and time, so both are kept.

`HeadLoss` is the interface the model calls (`Transformer.forward(..., labels=, head_loss=)`); the chunked
torch path is the reference and runs everywhere, liger-kernel's Triton kernel is an option on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshformer.batch import IGNORE_INDEX

# (hidden (..., D), labels (...), weight (V, D), bias (V,) | None) -> summed token loss (fp32 scalar)
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def default_chunk_rows(n_rows: int, vocab: int, d_model: int, device: torch.device) -> int:
    """Rows per chunk, at least 64. CUDA: a chunk of fp32 logits of ~512 MiB.

    Every chunk also adds its share into the fp32 weight gradient (a pass over V x D), so chunks must stay
    large enough for the three chunk GEMMs to dominate that pass. CPU: the chunk's elementwise passes are
    fastest when it stays in cache (~8 MiB of fp32 logits), but not below 2·d_model rows, where the V x D
    weight-gradient pass takes over; at most 512 MiB (faster than 128 MiB chunks: bench/fused_loss_memory.py).
    """
    if device.type == "cuda":
        return min(n_rows, max(64, 2**27 // vocab))
    rows = min(max(2**21 // vocab, 2 * d_model), 2**27 // vocab)
    return min(n_rows, max(64, rows))


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype `nn.Linear` would run in here: the autocast dtype if autocast is on, else the input's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


@dataclass(frozen=True)
class VocabShard:
    """Tensor parallel: this rank holds weight rows [start, start + local rows) of a `total`-row vocabulary."""

    group: dist.ProcessGroup
    start: int
    total: int


def local_targets(labels, valid, shard: VocabShard | None, local_vocab: int):
    """Per row: the target's column in this rank's logits (clamped, so ignored rows gather safely) and whether
    the target is here (single vocabulary: wherever the row is valid)."""
    if shard is None:
        return labels.clamp(min=0), valid
    local = labels - shard.start
    return local.clamp(0, local_vocab - 1), valid & (local >= 0) & (local < local_vocab)


def vocab_statistics(logits, labels, valid, shard: VocabShard | None, need_sum: bool):
    """Per row of fp32 logits: log-partition, target logit, sum of logits (label smoothing), local target index,
    target on this rank.

    Vocabulary-parallel (`shard`): one all-reduce for the row max, one for the stacked sums, so no rank ever
    holds more than its own columns (the Megatron formulation; `meshformer.loss.vocab_parallel` uses it too).
    """
    index, here = local_targets(labels, valid, shard, logits.shape[1])
    if shard is None:
        target = logits.gather(1, index[:, None]).squeeze(1)
        total = logits.sum(dim=-1) if need_sum else None
        return torch.logsumexp(logits, dim=-1), target, total, index, here
    row_max = logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)
    target = logits.gather(1, index[:, None]).squeeze(1) * here
    total = logits.sum(dim=-1) if need_sum else torch.zeros_like(row_max)
    sums = torch.stack([(logits - row_max[:, None]).exp().sum(dim=-1), target, total])
    dist.all_reduce(sums, group=shard.group)
    return row_max + sums[0].log(), sums[1], sums[2], index, here


def token_losses(lse, target, total, vocab: int, label_smoothing: float, z_loss: float) -> torch.Tensor:
    """Per-token loss from `vocab_statistics`: smoothed cross-entropy plus PaLM's z-loss (ignored rows not masked)."""
    per_token = (1.0 - label_smoothing) * (lse - target)
    if label_smoothing > 0:  # smoothing term: mean over the vocabulary of -log p
        per_token = per_token + label_smoothing * (lse - total / vocab)
    if z_loss > 0:
        per_token = per_token + z_loss * lse.square()
    return per_token


def logits_grad_(logits, lse, index, here, valid, vocab: int, label_smoothing: float, z_loss: float) -> torch.Tensor:
    """d loss / d logits = softmax * (1 + 2 z lse) - (1 - eps) onehot - eps / V, times each row's `valid` (the
    mask, or the mask times the incoming gradient); computed in place over the fp32 logits buffer (which it
    returns), so a chunk holds a single V-wide fp32 tensor."""
    grad = logits.sub_(lse[:, None]).exp_()
    if z_loss > 0:
        grad.mul_((1.0 + 2.0 * z_loss * lse)[:, None])
    grad.scatter_add_(1, index[:, None], ((label_smoothing - 1.0) * here.to(grad.dtype))[:, None])
    if label_smoothing > 0:
        grad.sub_(label_smoothing / vocab)
    return grad.mul_(valid[:, None])


def _chunk_loss_and_grad_(logits, labels, valid, vocab: int, label_smoothing: float, z_loss: float,
                          want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed loss of one chunk of fp32 logits and, if wanted, d loss / d logits, both from one in-place
    `log_softmax` (single vocabulary): log-probabilities, then their exp is the softmax, so the chunk takes
    ~3 elementwise passes (log_softmax, exp, the cast for the GEMMs) instead of the ~8 of `vocab_statistics`
    + `logits_grad_` (logsumexp's max, subtract, exp and sum, then subtract and exp again, then the mask).
    Same formulas as `token_losses`/`logits_grad_`; the logits buffer is overwritten and returned as the grad."""
    lse = torch.logsumexp(logits, dim=-1) if z_loss > 0 else None
    index = labels.clamp(min=0)[:, None]
    logp = torch.log_softmax(logits, dim=-1, out=logits)
    per_token = -(1.0 - label_smoothing) * logp.gather(1, index).squeeze(1)
    if label_smoothing > 0:  # smoothing term: mean over the vocabulary of -log p
        per_token = per_token - (label_smoothing / vocab) * logp.sum(dim=-1)
    if lse is not None:
        per_token = per_token + z_loss * lse.square()
    loss = (per_token * valid).sum()
    if not want_grad:
        return loss, None
    grad = logp.exp_()
    # Row scale: 0 on ignored rows, (1 + 2 z lse) with z-loss. Skipped when it is all ones; checking that is a
    # host sync, so only on CPU, where it is free and the skipped pass over the chunk is not.
    if lse is not None or logits.device.type != "cpu" or not bool(valid.all()):
        scale = valid.to(grad.dtype) if lse is None else valid * (1.0 + 2.0 * z_loss * lse)
        grad.mul_(scale[:, None])
    grad.scatter_add_(1, index, ((label_smoothing - 1.0) * valid.to(grad.dtype))[:, None])
    if label_smoothing > 0:
        grad.sub_((label_smoothing / vocab) * valid.to(grad.dtype)[:, None])
    return loss, grad


def _chunk_logits(h_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of one chunk of rows; the projection runs in the compute dtype, like `nn.Linear`."""
    logits = (h_c @ w.t()).float()
    return logits.add_(b) if b is not None else logits


def _operands(hidden, weight, bias, labels, dtype: torch.dtype, shard: VocabShard | None):
    """Rows of hidden states and labels, the weight in the compute dtype (a transient copy under autocast), the
    fp32 bias, and the whole vocabulary's size."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    vocab = shard.total if shard is not None else weight.shape[0]
    return h, y, weight.to(dtype), bias.float() if bias is not None else None, vocab


def _chunks(n_rows: int, chunk_rows: int) -> list[slice]:
    return [slice(start, start + chunk_rows) for start in range(0, n_rows, chunk_rows)]


class _HeadGradients:
    """Gradients of the hidden states, the weight (fp32) and the bias (fp32), summed chunk by chunk from each
    chunk's d loss / d logits: shared by the path that stores them and the path that recomputes them."""

    def __init__(self, h: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, need_h: bool, need_w: bool,
                 need_b: bool) -> None:
        self.dtype, self.need_w, self.weight_shape, self.device = dtype, need_w, weight.shape, weight.device
        self.h = torch.empty_like(h) if need_h else None
        self.w: torch.Tensor | None = None  # the first chunk's product initialises it (no zero fill and add pass)
        self.b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None

    def add(self, grad: torch.Tensor, rows: slice, h_c: torch.Tensor, w: torch.Tensor) -> None:
        if self.b is not None:
            self.b += grad.sum(dim=0)
        grad = grad.to(self.dtype)
        if self.h is not None:
            self.h[rows] = grad @ w
        if not self.need_w:
            return
        if self.w is None:
            self.w = (grad.t() @ h_c).float()
        elif self.dtype == torch.float32:
            self.w.addmm_(grad.t(), h_c)
        else:
            self.w += (grad.t() @ h_c).float()

    def finish(self, shard: VocabShard | None) -> tuple[torch.Tensor | None, ...]:
        if self.need_w and self.w is None:  # no rows at all
            self.w = torch.zeros(self.weight_shape, dtype=torch.float32, device=self.device)
        if shard is not None and self.h is not None:  # each rank's vocabulary columns gave a partial sum
            dist.all_reduce(self.h, group=shard.group)
        return self.h, self.w, self.b


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Gradients computed in the forward and stored; the backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_rows, label_smoothing, z_loss, want_grads, shard):
        dtype, eps = _compute_dtype(hidden.device, hidden.dtype), label_smoothing
        h, y, w, b, vocab = _operands(hidden, weight, bias, labels, dtype, shard)
        grads = _HeadGradients(h, weight, dtype, *(want_grads and ctx.needs_input_grad[i] for i in range(3)))
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for rows in _chunks(h.shape[0], chunk_rows):
            h_c, y_c = h[rows].to(dtype), y[rows]
            logits = _chunk_logits(h_c, w, b)
            valid = y_c != IGNORE_INDEX
            if shard is None:
                chunk_loss, grad = _chunk_loss_and_grad_(logits, y_c, valid, vocab, eps, z_loss, want_grads)
            else:
                lse, target, total, index, here = vocab_statistics(logits, y_c, valid, shard, eps > 0)
                chunk_loss = (token_losses(lse, target, total, vocab, eps, z_loss) * valid).sum()
                grad = logits_grad_(logits, lse, index, here, valid, vocab, eps, z_loss) if want_grads else None
            loss += chunk_loss
            if grad is not None:
                grads.add(grad, rows, h_c, w)
        ctx.save_for_backward(*grads.finish(shard))
        ctx.shape = hidden.shape
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss.float()
        out_h = (grad_h * scale).to(grad_h.dtype).view(ctx.shape) if grad_h is not None else None
        out_w = grad_w * scale if grad_w is not None else None
        out_b = grad_b * scale if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None


def _wanted(ctx, index: int) -> bool:
    """Whether this backward pass uses the gradient of input `index` (0 hidden, 1 weight, 2 bias).

    A zero-bubble schedule runs the loss's backward twice: for the stage input, then (deferred) for the
    weights; each pass recomputes only what it uses. torch 2.13 answers for a leaf that `autograd.grad`
    captures with a RuntimeError instead of True, and that leaf is used. Should torch drop this private query,
    every pass computes everything (correct, slower: tests/unit/loss/test_fused_loss.py counts the GEMMs).
    """
    if not ctx.needs_input_grad[index]:
        return False
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[index][0])
    except (RuntimeError, AttributeError):
        return True


class _RecomputedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the loss and each row's log-partition only. Backward: each chunk's logits again, then the same
    gradients as the stored path, scaled by the incoming gradient through the row weights."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_rows, label_smoothing, z_loss, want_grads, shard):
        dtype, eps = _compute_dtype(hidden.device, hidden.dtype), label_smoothing
        h, y, w, b, vocab = _operands(hidden, weight, bias, labels, dtype, shard)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for rows in _chunks(h.shape[0], chunk_rows):
            logits = _chunk_logits(h[rows].to(dtype), w, b)
            valid = y[rows] != IGNORE_INDEX
            row_lse, target, total, _, _ = vocab_statistics(logits, y[rows], valid, shard, eps > 0)
            loss += (token_losses(row_lse, target, total, vocab, eps, z_loss) * valid).sum()
            lse[rows] = row_lse
        if want_grads:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.settings = (dtype, chunk_rows, eps, z_loss, shard)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        dtype, chunk_rows, eps, z_loss, shard = ctx.settings  # autocast is off here: the forward's dtype
        h, y, w, b, vocab = _operands(hidden, weight, bias, labels, dtype, shard)
        grads = _HeadGradients(h, weight, dtype, *(_wanted(ctx, i) for i in range(3)))
        scale = grad_loss.float()
        for rows in _chunks(h.shape[0], chunk_rows):
            h_c, y_c = h[rows].to(dtype), y[rows]
            logits = _chunk_logits(h_c, w, b)
            valid = y_c != IGNORE_INDEX
            index, here = local_targets(y_c, valid, shard, logits.shape[1])
            grad = logits_grad_(logits, lse[rows], index, here, valid * scale, vocab, eps, z_loss)
            grads.add(grad, rows, h_c, w)
        grad_h, grad_w, grad_b = grads.finish(shard)
        out_h = grad_h.view(hidden.shape) if grad_h is not None else None
        return out_h, grad_w, grad_b, None, None, None, None, None, None


@torch.compiler.disable  # a graph break under whole-model compile: the chunk loop runs eagerly, as tested
def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    chunk_rows: int | None = None,
    shard: VocabShard | None = None,
    recompute: bool = False,
) -> torch.Tensor:
    """Summed loss of `hidden @ weight.T + bias` against labels, equal to cross_entropy_sum on the logits.

    With `shard` (tensor parallel) the weight/bias are this rank's vocabulary rows (DTensors are used through
    their local shard) and the hidden states are replicated; the loss is identical on every rank. `recompute`:
    the backward recomputes the logits instead of the forward storing the gradients (see the module notes).
    """
    weight = weight.to_local() if isinstance(weight, DTensor) else weight
    bias = bias.to_local() if isinstance(bias, DTensor) else bias
    n_rows = hidden.numel() // hidden.shape[-1]
    rows = chunk_rows or default_chunk_rows(n_rows, weight.shape[0], weight.shape[1], hidden.device)
    # Decided here: autograd runs Function.forward with grad mode off. Evaluation skips the gradient work.
    want_grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    function = _RecomputedLinearCrossEntropy if recompute else _ChunkedLinearCrossEntropy
    return function.apply(hidden, weight, bias, labels, rows, label_smoothing, z_loss, want_grads, shard)


def liger_available() -> bool:
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction  # noqa: F401
    except ImportError:
        return False
    return True


# A graph break under whole-model compile, like the chunked loss: dynamo cannot trace liger's autograd Function (torch
# 2.11: its fake-tensor addmm with out_dtype fails), and the kernel is fused already.
@torch.compiler.disable
def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """liger-kernel's Triton fused linear cross-entropy (CUDA), summed over non-ignored tokens."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    dtype = _compute_dtype(hidden.device, hidden.dtype)
    h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    loss = LigerFusedLinearCrossEntropyFunction.apply(
        h, weight.to(dtype), labels.reshape(-1), bias, None, IGNORE_INDEX, z_loss, label_smoothing, "sum",
        None, False, torch.float32)
    return (loss[0] if isinstance(loss, tuple) else loss).float()


def head_loss_fn(method: str, label_smoothing: float, z_loss: float, shard: VocabShard | None = None,
                 chunk_rows: int | None = None) -> HeadLoss:
    """The fused head loss named by train.loss ("chunked", "chunked_recompute" or "liger"; vocabulary-parallel with
    `shard`; `chunk_rows` None: `default_chunk_rows`)."""
    if method == "liger":
        if shard is not None:
            raise ValueError("liger's fused linear cross-entropy is not vocabulary-parallel; use 'chunked'")

        def head_loss(hidden, labels, weight, bias):
            return liger_linear_cross_entropy(hidden, labels, weight, bias, label_smoothing=label_smoothing,
                                              z_loss=z_loss)
    else:
        recompute = method == "chunked_recompute"

        def head_loss(hidden, labels, weight, bias):
            return chunked_linear_cross_entropy(hidden, labels, weight, bias, label_smoothing=label_smoothing,
                                                z_loss=z_loss, chunk_rows=chunk_rows, shard=shard,
                                                recompute=recompute)

    head_loss.method = method  # type: ignore[attr-defined]  # a label for the run report
    return head_loss
