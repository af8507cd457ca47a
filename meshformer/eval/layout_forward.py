"""lm-eval's requests through a layout's evaluation forward.

`ParallelModel.evaluate` (tensor, pipeline, context, expert and data parallel alike) gives the summed
log-likelihoods of (context, continuation) rows, and the next-token logits of token sequences for generation
without a whole model on any rank.

The model's loss is swapped for a recorder: per-row plain cross-entropy of full-vocabulary logits (no label
smoothing or z-loss) for scoring, the logits at one labelled position per row for generation. Each data-parallel
rank takes a slice of the rows; the ranks that hold a row's result (one tensor-parallel rank each or every rank's
vocabulary slice, the last pipeline stage, the context-parallel rank holding the position) add theirs into one
tensor that an all-reduce makes whole on every rank. The in-loop evaluation (train/downstream.py) and
`meshformer eval --set parallel.*` run it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX, Batch
from meshformer.config import Config
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import VocabShard
from meshformer.loss.objective import Loss
from meshformer.loss.token_loss import LossSpec
from meshformer.parallel.mesh_model import MultiRankParallelModel
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.tensor_parallel import vocab_shard

# ----------------------------------------------------------------------------------------------- requests


def request_row(context: list[int], continuation: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one request: the last seq_len + 1 tokens (lm-eval's left truncation) shifted by one;
    labels mark the continuation's tokens only."""
    tokens = (context + continuation)[-(seq_len + 1):]
    inputs = tokens[:-1]
    n_scored = min(len(continuation), len(inputs))
    return inputs, [IGNORE_INDEX] * (len(inputs) - n_scored) + tokens[len(tokens) - n_scored:]


def padded_length(longest: int, seq_len: int, multiple: int) -> int:
    """A batch's length: its longest row rounded up to `multiple` (what context and sequence parallel split evenly),
    at most seq_len (which the layout's checks already made divisible)."""
    return min(seq_len, -(-longest // multiple) * multiple)


def _split_multiple(model: ParallelModel) -> int:
    """What a batch's length rounds up to: context parallel's 2 * cp pieces, each split over tensor parallel."""
    split = 2 * model.dims.cp * model.dims.tp if isinstance(model, MultiRankParallelModel) else 1
    return math.lcm(8, split)


# ----------------------------------------------------------------------------------------------- scoring


class _RowLosses:
    """A loss function for the layout's evaluation that records each row's summed cross-entropy and how many of its
    labelled tokens are not the argmax of the logits (lm-eval's `is_greedy` holds when that count is 0)."""

    def __init__(self, logits_loss: LossFn, shard: VocabShard | None = None) -> None:
        self.logits_loss, self.shard = logits_loss, shard
        self.rows: list[torch.Tensor] = []
        self.misses: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_row = torch.stack([self.logits_loss(logits[i:i + 1], labels[i:i + 1]).float()
                               for i in range(logits.shape[0])])
        self.rows.append(per_row.detach())
        self.misses.append(self._not_greedy(logits.detach().float(), labels))
        return per_row.sum()

    def _not_greedy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per row: labelled tokens whose label is not the argmax. Under tensor parallel each rank holds a slice of
        the vocabulary: the row maxima and the label's logit are made whole with two MAX all-reduces."""
        valid = labels != IGNORE_INDEX
        if self.shard is None:
            return ((logits.argmax(-1) != labels) & valid).sum(-1).float()
        local = labels - self.shard.start
        here = valid & (local >= 0) & (local < logits.shape[-1])
        top = logits.amax(-1)
        target = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0]
        target = torch.where(here, target, torch.full_like(target, -torch.inf))
        both = torch.stack([top, target])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.shard.group)
        return ((both[1] < both[0]) & valid).sum(-1).float()


@contextmanager
def _row_losses(model: ParallelModel, cfg: Config) -> Iterator[tuple[_RowLosses, Loss]]:
    """The layout's objective with per-row plain cross-entropy as its token loss (full logits, this rank's
    vocabulary shard under tensor parallel), for `ParallelModel.evaluate(batch, loss)`, and the rows' recorder."""
    shard = None
    if isinstance(model, MultiRankParallelModel) and model.dims.tp_enabled:
        shard = VocabShard(model.meshes.tp.get_group(), vocab_shard(cfg.model, model.meshes.tp)[0],
                           cfg.model.vocab_size)
    recorder = _RowLosses(LossSpec("plain").bind(shard).logits_loss, shard)
    yield recorder, model.loss.with_token_loss(recorder)


def _reports_rows(model: ParallelModel) -> bool:
    """Whether this rank's row losses count in the sum: the last pipeline stage's first tensor-parallel rank (each
    context-parallel rank holds a part of every row's tokens, each data-parallel rank its own rows)."""
    if isinstance(model, MultiRankParallelModel):
        return model.reports_loss and model.meshes.tp_rank == 0
    return True


@torch.no_grad()
def score_rows_greedy(model: ParallelModel, cfg: Config, rows: list[tuple[list[int], list[int]]], batch_size: int,
                      pad_id: int, seq_len: int, poll: Callable[[], None] = lambda: None) -> list[tuple[float, bool]]:
    """(summed log-likelihood of each row's labelled tokens, whether each of them is the model's argmax), identical
    on every rank (a collective).

    Each data-parallel rank scores every dp-th row; every rank runs the same number of batches (rows of padding
    carry no labels), so the layout's collectives line up. A batch is as long as its longest row (rounded up).
    `poll` runs before each batch (the run's stop check: it raises to leave the scoring, on every rank alike)."""
    dp_rank, dp_size = model.dp_rank, model.dp_size
    # longest first, dealt out in turn: every rank's k-th batch holds rows of about the same length
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    mine = order[dp_rank::dp_size]
    n_batches = math.ceil(math.ceil(len(rows) / dp_size) / batch_size)
    multiple = _split_multiple(model)
    totals = torch.zeros(len(rows), dtype=torch.float32, device=model.device)
    misses = torch.zeros(len(rows), dtype=torch.float32, device=model.device)
    counts = _reports_rows(model)
    for part in model.model_parts:
        part.eval()
    try:
        with _row_losses(model, cfg) as (recorder, row_loss):
            for b in range(n_batches):
                poll()
                picked = mine[b * batch_size:(b + 1) * batch_size]
                length = padded_length(max((len(rows[i][0]) for i in picked), default=1), seq_len, multiple)
                ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
                labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
                for row, i in enumerate(picked):  # right padding: a causal model's scores ignore what follows
                    ids[row, :len(rows[i][0])] = torch.tensor(rows[i][0])
                    labels[row, :len(rows[i][1])] = torch.tensor(rows[i][1])
                batch: Batch = {"input_ids": ids.to(model.device), "labels": labels.to(model.device)}
                recorder.rows.clear()
                recorder.misses.clear()
                model.evaluate(batch, row_loss)
                if counts and recorder.rows and picked:
                    where = torch.tensor(picked, device=model.device)
                    totals.index_add_(0, where, -torch.cat(recorder.rows)[:len(picked)])
                    misses.index_add_(0, where, torch.cat(recorder.misses)[:len(picked)])
    finally:
        for part in model.model_parts:
            part.train()
    both = torch.stack([totals, misses])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(both)
    return [(loglik, miss == 0) for loglik, miss in zip(both[0].tolist(), both[1].tolist())]



class LayoutScorer:
    """MeshformerLM's scoring backend in the loop: lm-eval's tokenized (context, continuation) pairs scored by the
    layout's evaluation forward (`score_rows_greedy`: tensor, pipeline, context, expert and data parallel alike)."""

    def __init__(self, model: ParallelModel, cfg: Config, batch_size: int, pad_id: int,
                 poll: Callable[[], None]) -> None:
        self.model, self.cfg, self.batch_size, self.pad_id, self.poll = model, cfg, batch_size, pad_id, poll

    def __call__(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        seq_len = self.cfg.data.seq_len
        rows = [request_row(context, continuation, seq_len) for context, continuation in pairs]
        return score_rows_greedy(self.model, self.cfg, rows, self.batch_size, self.pad_id, seq_len, self.poll)


# ----------------------------------------------------------------------------------------------- generation


class _NextLogits:
    """A loss function for the layout's evaluation that records each row's logits at its one labelled position
    (the next-token logits of the row's tokens up to there), in full-vocabulary columns: this rank's slice under
    tensor parallel, zeros where this context-parallel rank does not hold the position."""

    def __init__(self, vocab_size: int, shard: VocabShard | None = None) -> None:
        self.vocab_size, self.start = vocab_size, shard.start if shard is not None else 0
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(logits.shape[0], self.vocab_size, dtype=torch.float32, device=logits.device)
        rows, positions = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        out[rows, self.start:self.start + logits.shape[-1]] = logits.detach()[rows, positions].float()
        self.rows.append(out)
        return logits.float().sum() * 0.0  # the loss value is not used


@torch.no_grad()
def next_token_logits(model: ParallelModel, cfg: Config, sequences: list[list[int]], batch_size: int, pad_id: int,
                      seq_len: int) -> torch.Tensor:
    """(len(sequences), vocabulary) fp32 logits of the token after each sequence, identical on every rank (a
    collective; every rank passes the same sequences). Each data-parallel rank runs a slice of them, in batches
    of `batch_size` rows as long as their longest (rounded up), right-padded; every rank runs as many batches."""
    dp_rank, dp_size = model.dp_rank, model.dp_size
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    mine = order[dp_rank::dp_size]
    n_batches = math.ceil(math.ceil(len(sequences) / dp_size) / batch_size)
    multiple = _split_multiple(model)
    shard = None
    if isinstance(model, MultiRankParallelModel) and model.dims.tp_enabled:
        shard = VocabShard(model.meshes.tp.get_group(), vocab_shard(cfg.model, model.meshes.tp)[0],
                           cfg.model.vocab_size)
    recorder = _NextLogits(cfg.model.vocab_size, shard)
    loss = model.loss.with_token_loss(recorder)
    out = torch.zeros(len(sequences), cfg.model.vocab_size, dtype=torch.float32, device=model.device)
    was_training = [part.training for part in model.model_parts]
    for part in model.model_parts:
        part.eval()
    try:
        for b in range(n_batches):
            picked = mine[b * batch_size:(b + 1) * batch_size]
            length = padded_length(max((len(sequences[i]) for i in picked), default=1), seq_len, multiple)
            ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
            labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
            for row, i in enumerate(picked):
                ids[row, :len(sequences[i])] = torch.tensor(sequences[i])
                labels[row, len(sequences[i]) - 1] = 0  # marks the position whose logits are recorded
            batch: Batch = {"input_ids": ids.to(model.device), "labels": labels.to(model.device)}
            recorder.rows.clear()
            model.evaluate(batch, loss)
            if recorder.rows and picked:
                out[torch.tensor(picked, device=model.device)] += torch.cat(recorder.rows)[:len(picked)]
    finally:
        for part, training in zip(model.model_parts, was_training):
            part.train(training)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


class LayoutNextLogits:
    """MeshformerLM's generation backend without a whole model: each decoding step's next-token logits from the
    layout's evaluation forward over the whole prefix (no cache). A call takes a batch per data-parallel rank."""

    def __init__(self, model: ParallelModel, cfg: Config, batch_size: int, pad_id: int) -> None:
        self.model, self.cfg, self.batch_size, self.pad_id = model, cfg, batch_size, pad_id
        self.rows_per_call = batch_size * model.dp_size

    def __call__(self, sequences: list[list[int]]) -> torch.Tensor:
        return next_token_logits(self.model, self.cfg, sequences, self.batch_size, self.pad_id, self.cfg.data.seq_len)
