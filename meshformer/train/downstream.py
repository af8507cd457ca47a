"""Downstream evaluation in the training loop, through lm-evaluation-harness' own evaluator.

`downstream.tasks` names lm-eval tasks: bundled ones, local task YAMLs (read as data: meshformer/eval/task_files.py),
and names from lm-eval's registry or `downstream.include_path`. lm-eval's evaluator renders the prompts, builds the
requests and computes the metrics over MeshformerLM (meshformer/eval/lm.py), whose log-likelihood requests
(multiple choice, loglikelihood, rolling perplexity) are scored here by the layout's own held-out evaluation
(`ParallelModel.evaluate`, pipeline stages included), with the loss swapped for one that records each row's summed
cross-entropy of full-vocabulary logits (no label smoothing or z-loss) and whether each label is the argmax. Each
data-parallel rank scores a slice of the requests; the ranks that report the loss (one tensor-parallel rank each,
the last pipeline stage, every context-parallel chunk) add theirs into one vector that an all-reduce makes whole on
every rank, so every rank's lm-eval sees the same scores.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX, Batch
from meshformer.config import Config
from meshformer.data import Tokenizer
from meshformer.errors import ConfigError
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import VocabShard
from meshformer.loss.objective import Loss
from meshformer.loss.token_loss import LossSpec
from meshformer.model import Transformer
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
    split = 2 * model.dims.cp * model.dims.tp if isinstance(model, MultiRankParallelModel) else 1
    multiple = math.lcm(8, split)
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


# ----------------------------------------------------------------------------------------------- through lm-eval


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


class DownstreamEval:
    """downstream.tasks scored by lm-eval's evaluator over MeshformerLM, whose log-likelihood requests run through
    the training layout (every rank runs the evaluator on all requests; the layout shares the rows between
    data-parallel ranks and makes the scores whole on every rank)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.batch_size = cfg.downstream.batch_size or cfg.data.batch_size
        self.last: dict[str, dict[str, float]] = {}

    @classmethod
    def from_config(cls, cfg: Config, tokenizer: Tokenizer) -> DownstreamEval | None:
        """The scorer of downstream.tasks, checked (None: none listed)."""
        check_tasks(cfg, render=False)
        return cls(cfg, tokenizer) if cfg.downstream.tasks else None

    def due(self, step: int, last: bool) -> bool:
        """downstream.interval, else train.eval_interval, else only the last step."""
        interval = self.cfg.downstream.interval or self.cfg.train.eval_interval
        return last or (interval > 0 and step % interval == 0)

    def run(self, model: ParallelModel, poll: Callable[[], None] = lambda: None,
            whole: Transformer | None = None) -> dict[str, float]:
        """Every task's metrics and standard errors as `downstream/<task>/<metric>` scalars (the same on every
        rank); `whole`: the whole model on this rank when the layout keeps one (generation tasks need it); `poll`:
        the run's stop check, run before each batch of requests (it raises to leave the scoring, on every rank
        alike)."""
        from meshformer.eval.lm import MeshformerLM
        from meshformer.eval.run import evaluate

        start = time.perf_counter()
        options = self.cfg.downstream
        was_training = [part.training for part in model.model_parts]  # MeshformerLM puts `whole` in eval mode
        scorer = LayoutScorer(model, self.cfg, self.batch_size, self.tokenizer.pad_id, poll)
        lm = MeshformerLM(model=whole, tokenizer=self.tokenizer, scorer=scorer, batch_size=self.batch_size,
                          max_length=self.cfg.data.seq_len, poll=poll)
        limit = None if not options.limit else int(options.limit) if options.limit >= 1 else options.limit
        try:
            results = evaluate(lm, list(options.tasks), include_path=list(options.include_path),
                               num_fewshot=None if options.num_fewshot < 0 else options.num_fewshot,
                               limit=limit, options=options)
        finally:
            for part, training in zip(model.model_parts, was_training):
                part.train(training)
        assert results is not None  # every rank is lm-eval's rank 0 of 1
        scalars: dict[str, float] = {}
        self.last = {}
        for task, metrics in results["results"].items():
            values = {}
            for key, value in metrics.items():  # "metric,filter" (alias and sample_len are not metrics)
                metric, comma, filter_name = key.partition(",")
                if not comma or not isinstance(value, int | float) or isinstance(value, bool):
                    continue
                name = metric if filter_name == "none" else f"{metric}_{filter_name}"
                values[name] = float(value)
            self.last[task] = values
            scalars |= {f"downstream/{task}/{name}": value for name, value in values.items()}
        scalars["downstream/time_s"] = time.perf_counter() - start
        return scalars

    def describe(self, step: int, scalars: dict[str, float]) -> str:
        parts = []
        for task, values in self.last.items():
            shown = [f"{name} {value:.4g}" for name, value in values.items() if not name.endswith("_stderr")][:3]
            parts.append(f"{task} " + " ".join(shown))
        return f"downstream {step:>6} | " + " | ".join(parts)


def check_tasks(cfg: Config, render: bool = True) -> None:
    """downstream.tasks before step 1: task files read as data and (`render`) each document rendered in the
    sandbox, include paths without task code unless trusted, and each registry task's dataset in the local cache
    (else one line with the command that fetches it)."""
    from meshformer.eval.cli import check_datasets
    from meshformer.eval.run import check_include_paths, is_task_file
    from meshformer.eval.task_files import lm_eval_config, rendered_docs

    options = cfg.downstream
    if options.interval < 0 or options.batch_size < 0 or options.limit < 0:
        raise ConfigError(f"downstream.interval={options.interval}, downstream.batch_size={options.batch_size} and "
                          f"downstream.limit={options.limit} must be >= 0", "use 0 for their defaults")
    if options.max_task_mb <= 0:
        raise ConfigError(f"downstream.max_task_mb={options.max_task_mb} must be positive",
                          "give the most MiB of JSONL documents one task may hold (default 64)")
    if not options.tasks:
        return
    if cfg.objective != "causal":
        raise ConfigError(f"downstream.tasks scores continuations with a causal language model, but this run's "
                          f"objective is {cfg.objective!r}", "remove downstream.tasks for this model")
    for folder in options.include_path:
        if not Path(folder).is_dir():
            raise ConfigError(f"downstream.include_path: {folder} is not a folder", "give a folder of task YAMLs")
    check_include_paths(list(options.include_path), options.trust_task_code)
    for spec in options.tasks:
        if is_task_file(spec):
            if render:
                rendered_docs(spec, options)
            else:
                lm_eval_config(spec, options)
    check_datasets([s for s in options.tasks if not is_task_file(s)], list(options.include_path))
