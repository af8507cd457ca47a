"""Downstream evaluation in the training loop: zero-shot multiple-choice tasks in lm-evaluation-harness' format.

A task is lm-eval's local-task YAML (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`, `doc_to_text` /
`doc_to_choice` / `doc_to_target` as column names, Jinja templates or literal lists) beside its JSONL documents:
nothing is downloaded; meshformer/eval/task_files.py reads it, as data (sandboxed templates, files inside its folder).
Each choice is scored as lm-eval's HFLM scores it: the summed log-likelihood of
`target_delimiter + choice` after the context (trailing spaces of the context move to the continuation, the pair is
tokenized whole and split where the context's tokens end, the sequence is cut from the left to the model's length);
acc takes the argmax of the log-likelihoods, acc_norm of log-likelihood / characters of the choice, acc_bytes of
log-likelihood / UTF-8 bytes of the choice (lm-eval 0.4.13, api/task.py `process_results`).

The model runs through the layout's own held-out evaluation (`ParallelModel.evaluate`, pipeline stages included),
with the loss swapped for one that records each row's summed cross-entropy of full-vocabulary logits (no label
smoothing or z-loss). Each data-parallel rank scores a slice of the requests; the ranks that report the loss (one
tensor-parallel rank each, the last pipeline stage, every context-parallel chunk) add theirs into one vector that an
all-reduce makes whole on every rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX, Batch
from meshformer.config import Config
from meshformer.data import Tokenizer
from meshformer.eval.task_files import Task, load_tasks
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import VocabShard
from meshformer.loss.objective import Loss
from meshformer.loss.token_loss import LossSpec
from meshformer.parallel.mesh_model import MultiRankParallelModel
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.tensor_parallel import vocab_shard

METRICS = ("acc", "acc_norm", "acc_bytes", "loglik_per_token", "loglik_per_byte")


@dataclass
class TaskScores:
    """One task's metrics and, per document, the summed log-likelihood of each choice."""

    metrics: dict[str, float]
    logliks: list[list[float]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- requests


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (HFLM, causal models, no added BOS)."""
    if context == "":
        cont = tokenizer.encode(continuation)
        return ([tokenizer.bos_id], cont) if cont and cont[0] != tokenizer.bos_id else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    n_context = len(tokenizer.encode(context))
    return whole[:n_context], whole[n_context:]


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


# ----------------------------------------------------------------------------------------------- scoring


class _RowLosses:
    """A loss function for the layout's evaluation that records each row's summed cross-entropy."""

    def __init__(self, logits_loss: LossFn) -> None:
        self.logits_loss = logits_loss
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        per_row = torch.stack([self.logits_loss(logits[i:i + 1], labels[i:i + 1]).float()
                               for i in range(logits.shape[0])])
        self.rows.append(per_row.detach())
        return per_row.sum()


@contextmanager
def _row_losses(model: ParallelModel, cfg: Config) -> Iterator[tuple[_RowLosses, Loss]]:
    """The layout's objective with per-row plain cross-entropy as its token loss (full logits, this rank's
    vocabulary shard under tensor parallel), for `ParallelModel.evaluate(batch, loss)`, and the rows' recorder."""
    shard = None
    if isinstance(model, MultiRankParallelModel) and model.dims.tp_enabled:
        shard = VocabShard(model.meshes.tp.get_group(), vocab_shard(cfg.model, model.meshes.tp)[0],
                           cfg.model.vocab_size)
    recorder = _RowLosses(LossSpec("plain").bind(shard).logits_loss)
    yield recorder, model.loss.with_token_loss(recorder)


def _reports_rows(model: ParallelModel) -> bool:
    """Whether this rank's row losses count in the sum: the last pipeline stage's first tensor-parallel rank (each
    context-parallel rank holds a part of every row's tokens, each data-parallel rank its own rows)."""
    if isinstance(model, MultiRankParallelModel):
        return model.reports_loss and model.meshes.tp_rank == 0
    return True


@torch.no_grad()
def score_rows(model: ParallelModel, cfg: Config, rows: list[tuple[list[int], list[int]]], batch_size: int,
               pad_id: int, seq_len: int, poll: Callable[[], None] = lambda: None) -> list[float]:
    """The summed log-likelihood of each row's labelled tokens, identical on every rank (a collective).

    Each data-parallel rank scores every dp-th row; every rank runs the same number of batches (rows of padding
    carry no labels), so the layout's collectives line up. A batch is as long as its longest row (rounded up).
    `poll` runs before each batch (the run's stop check: it raises to leave the scoring, on every rank alike)."""
    dp_rank, dp_size = model.dp_rank, model.dp_size
    # longest first, dealt out in turn: every rank's k-th batch holds rows of about the same length
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    mine = order[dp_rank::dp_size]
    n_batches = math.ceil(math.ceil(len(rows) / dp_size) / batch_size)
    split = 2 * model.dims.cp * model.dims.tp if isinstance(model, MultiRankParallelModel) else 1
    multiple = math.lcm(8, split)
    totals = torch.zeros(len(rows), dtype=torch.float32, device=model.device)
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
                model.evaluate(batch, row_loss)
                if counts and recorder.rows and picked:
                    losses = torch.cat(recorder.rows)[:len(picked)]
                    totals.index_add_(0, torch.tensor(picked, device=model.device), -losses)
    finally:
        for part in model.model_parts:
            part.train()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return totals.tolist()


def task_scores(task: Task, logliks: list[list[float]], tokens: list[int]) -> dict[str, float]:
    """lm-eval's acc / acc_norm / acc_bytes, and the correct continuations' log-likelihood per token and per byte
    (`tokens`: the correct continuation's token count per document)."""
    acc = acc_norm = acc_bytes = 0.0
    gold_ll, gold_bytes = 0.0, 0
    for doc, lls in zip(task.docs, logliks):
        values = np.array(lls)
        chars = np.array([float(len(c)) for c in doc.choices])
        utf8 = np.array([float(len(c.encode("utf-8"))) for c in doc.choices])
        acc += float(np.argmax(values) == doc.gold)
        acc_norm += float(np.argmax(values / chars) == doc.gold)
        acc_bytes += float(np.argmax(values / utf8) == doc.gold)
        gold_ll += lls[doc.gold]
        gold_bytes += len((task.target_delimiter + doc.choices[doc.gold]).encode("utf-8"))
    n = len(task.docs)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "acc_bytes": acc_bytes / n,
            "loglik_per_token": gold_ll / max(sum(tokens), 1), "loglik_per_byte": gold_ll / max(gold_bytes, 1)}


class DownstreamEval:
    """The run's downstream tasks, tokenized once; `run` scores them under the run's layout."""

    def __init__(self, cfg: Config, tasks: list[Task], tokenizer: Tokenizer) -> None:
        self.cfg, self.tasks = cfg, tasks
        self.pad_id = tokenizer.pad_id
        self.batch_size = cfg.downstream.batch_size or cfg.data.batch_size
        self.rows: list[tuple[list[int], list[int]]] = []
        self.gold_tokens: dict[str, list[int]] = {}
        for task in tasks:
            gold = []
            for doc in task.docs:
                for i, choice in enumerate(doc.choices):
                    context, continuation = encode_pair(tokenizer, doc.context, task.target_delimiter + choice)
                    self.rows.append(request_row(context, continuation, cfg.data.seq_len))
                    if i == doc.gold:
                        gold.append(sum(1 for label in self.rows[-1][1] if label != IGNORE_INDEX))
            self.gold_tokens[task.name] = gold
        self.last: dict[str, TaskScores] = {}

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Tokenizer) -> DownstreamEval | None:
        """The tasks of downstream.tasks, tokenized (None: none listed)."""
        tasks = load_tasks(cfg)
        return cls(cfg, tasks, tokenizer) if tasks else None

    def due(self, step: int, last: bool) -> bool:
        """downstream.interval, else train.eval_interval, else only the last step."""
        interval = self.cfg.downstream.interval or self.cfg.train.eval_interval
        return last or (interval > 0 and step % interval == 0)

    def run(self, model: ParallelModel, poll: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Every task's metrics as `downstream/<task>/<metric>` scalars (the same on every rank); `poll`: as for
        `score_rows`."""
        start = time.perf_counter()
        logliks = score_rows(model, self.cfg, self.rows, self.batch_size, self.pad_id, self.cfg.data.seq_len, poll)
        scalars: dict[str, float] = {}
        at = 0
        for task in self.tasks:
            per_doc = []
            for doc in task.docs:
                per_doc.append(logliks[at:at + len(doc.choices)])
                at += len(doc.choices)
            metrics = task_scores(task, per_doc, self.gold_tokens[task.name])
            self.last[task.name] = TaskScores(metrics, per_doc)
            scalars |= {f"downstream/{task.name}/{key}": value for key, value in metrics.items()}
        scalars["downstream/time_s"] = time.perf_counter() - start
        return scalars

    def describe(self, step: int, scalars: dict[str, float]) -> str:
        parts = [f"{t.name} acc {scalars[f'downstream/{t.name}/acc']:.3f} acc_norm "
                 f"{scalars[f'downstream/{t.name}/acc_norm']:.3f}" for t in self.tasks]
        return f"downstream {step:>6} | " + " | ".join(parts)

