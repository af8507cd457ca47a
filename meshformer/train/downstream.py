"""Downstream evaluation in the training loop, through lm-evaluation-harness' own evaluator.

`downstream.tasks` names lm-eval tasks: bundled ones, local task YAMLs (read as data: meshformer/eval/task_files.py),
and names from lm-eval's registry or `downstream.include_path`. lm-eval's evaluator renders the prompts, builds the
requests and computes the metrics over MeshformerLM (meshformer/eval/lm.py), whose log-likelihood requests
(multiple choice, loglikelihood, rolling perplexity) are scored here by the layout's own held-out evaluation
(`ParallelModel.evaluate`, pipeline stages included), with the loss swapped for one that records each row's summed
cross-entropy of full-vocabulary logits (no label smoothing or z-loss) and whether each label is the argmax. Each
data-parallel rank scores a slice of the requests; the ranks that report the loss (one tensor-parallel rank each,
the last pipeline stage, every context-parallel chunk) add theirs into one vector that an all-reduce makes whole on
every rank, so every rank's lm-eval sees the same scores (meshformer/eval/layout_forward.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from meshformer.config import Config
from meshformer.data import Tokenizer
from meshformer.errors import ConfigError
from meshformer.eval.layout_forward import (  # noqa: F401 (request_row, padded_length, _RowLosses: where tests look)
    LayoutNextLogits,
    LayoutScorer,
    _RowLosses,
    padded_length,
    request_row,
    score_rows_greedy,
)
from meshformer.model import Transformer
from meshformer.parallel.parallel_model import ParallelModel


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
