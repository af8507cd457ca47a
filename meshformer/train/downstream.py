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

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshformer.batch import IGNORE_INDEX
from meshformer.config import Config
from meshformer.data import Tokenizer
from meshformer.errors import ConfigError
from meshformer.eval.layout_forward import (  # noqa: F401 (padded_length, _RowLosses: where tests look for them)
    LayoutNextLogits,
    LayoutScorer,
    _RowLosses,
    padded_length,
    request_row,
    score_rows_greedy,
)
from meshformer.eval.task_files import Task, load_tasks
from meshformer.model import Transformer
from meshformer.parallel.parallel_model import ParallelModel

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


# ----------------------------------------------------------------------------------------------- scoring


def score_rows(model: ParallelModel, cfg: Config, rows: list[tuple[list[int], list[int]]], batch_size: int,
               pad_id: int, seq_len: int, poll: Callable[[], None] = lambda: None) -> list[float]:
    """The summed log-likelihood of each row's labelled tokens, identical on every rank (a collective)."""
    return [loglik for loglik, _ in score_rows_greedy(model, cfg, rows, batch_size, pad_id, seq_len, poll)]


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
    def from_config(cls, cfg: Config, tokenizer: Tokenizer) -> DownstreamEval | LmEvalDownstream | None:
        """The scorer of downstream.tasks under downstream.engine (None: none listed)."""
        if cfg.downstream.engine == "lm_eval":
            check_lm_eval_tasks(cfg)
            return LmEvalDownstream(cfg, tokenizer) if cfg.downstream.tasks else None
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



# ----------------------------------------------------------------------------------------------- through lm-eval


class LmEvalDownstream:
    """downstream.engine = "lm_eval": downstream.tasks scored by lm-eval's evaluator over MeshformerLM, whose
    log-likelihood requests run through the training layout (every rank runs the evaluator on all requests; the
    layout shares the rows between data-parallel ranks and makes the scores whole on every rank)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.batch_size = cfg.downstream.batch_size or cfg.data.batch_size
        self.last: dict[str, dict[str, float]] = {}

    def due(self, step: int, last: bool) -> bool:
        interval = self.cfg.downstream.interval or self.cfg.train.eval_interval
        return last or (interval > 0 and step % interval == 0)

    def run(self, model: ParallelModel, poll: Callable[[], None] = lambda: None,
            whole: Transformer | None = None) -> dict[str, float]:
        """Every task's metrics and standard errors as `downstream/<task>/<metric>` scalars (the same on every
        rank); `whole`: the whole model on this rank when the layout keeps one (generation through its caches)."""
        from meshformer.eval.lm import MeshformerLM
        from meshformer.eval.run import evaluate

        start = time.perf_counter()
        options = self.cfg.downstream
        was_training = [part.training for part in model.model_parts]  # MeshformerLM puts `whole` in eval mode
        scorer = LayoutScorer(model, self.cfg, self.batch_size, self.tokenizer.pad_id, poll)
        # without a whole model on the rank (pipeline stages), generation steps through the layout's forward
        stepwise = None if whole is not None else LayoutNextLogits(model, self.cfg, self.batch_size,
                                                                   self.tokenizer.pad_id)
        lm = MeshformerLM(model=whole, tokenizer=self.tokenizer, scorer=scorer, batch_size=self.batch_size,
                          max_length=self.cfg.data.seq_len, poll=poll, next_logits=stepwise)
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


def check_lm_eval_tasks(cfg: Config) -> None:
    """downstream.engine = "lm_eval" before step 1: task files read as data (refused as the builtin engine refuses
    them), include paths without task code unless trusted, and each registry task's dataset in the local cache (else
    one line with the command that fetches it)."""
    from meshformer.eval.cli import check_datasets
    from meshformer.eval.run import check_include_paths, is_task_file
    from meshformer.eval.task_files import lm_eval_config

    options = cfg.downstream
    if options.engine not in ("builtin", "lm_eval"):
        raise ConfigError(f"downstream.engine={options.engine!r} is not an engine", 'use "builtin" or "lm_eval"')
    if options.interval < 0 or options.batch_size < 0 or options.limit < 0:
        raise ConfigError(f"downstream.interval={options.interval}, downstream.batch_size={options.batch_size} and "
                          f"downstream.limit={options.limit} must be >= 0", "use 0 for their defaults")
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
            lm_eval_config(spec, options)
    check_datasets([s for s in options.tasks if not is_task_file(s)], list(options.include_path))
