"""Scoring tasks with lm-eval's evaluator over meshformer's `LM`: task names from lm-eval's registry or an
include path, and local task files read as data (task_files.lm_eval_config), with templates rendered in the sandbox
unless the user trusts the task code."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from meshformer.config.sections import DownstreamConfig
from meshformer.eval.task_files import lm_eval_config
from meshformer.eval.task_templates import TRUST_FIX, TaskCodeError, _sandbox, render_error


def is_task_file(spec: str) -> bool:
    """A bundled task or the path of a YAML (anything else is a name for lm-eval's task index)."""
    return spec.startswith("bundled:") or spec.endswith((".yaml", ".yml")) or os.sep in spec


@contextmanager
def template_environment(trust: bool) -> Iterator[None]:
    """lm-eval renders every template with one module-level jinja2 Environment: while tasks are read and scored it
    is the sandbox of meshformer/eval/task_templates.py, unless `trust` (then it is lm-eval's own)."""
    import lm_eval.utils

    saved = lm_eval.utils.env
    if not trust:
        lm_eval.utils.env = _sandbox()
    try:
        yield
    finally:
        lm_eval.utils.env = saved


@contextmanager
def _local_rank_zero(alone: bool) -> Iterator[None]:
    """lm-eval's evaluator returns results only where LOCAL_RANK is 0 (it takes other ranks for tensor-parallel
    copies of rank 0). An LM that does not share requests between ranks (`alone`: the training layout's scorer, which
    makes every rank's scores whole) is lm-eval's only rank on each of them, so each gets the results."""
    saved = os.environ.get("LOCAL_RANK")
    if alone and saved is not None:
        os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if saved is not None:
            os.environ["LOCAL_RANK"] = saved


def check_include_paths(paths: list[str], trust: bool) -> None:
    """lm-eval imports the Python of a folder's `!function` tags itself: refused unless trusted."""
    if trust:
        return
    for folder in paths:
        for yaml_file in sorted(Path(folder).rglob("*.y*ml")):
            if "!function" in yaml_file.read_text(encoding="utf-8", errors="replace"):
                raise TaskCodeError(f"include path {folder}: {yaml_file.name} runs Python code (!function)", TRUST_FIX)


def evaluate(lm: Any, specs: list[str], *, include_path: list[str] | None = None, num_fewshot: int | None = None,
             limit: int | float | None = None, options: DownstreamConfig | None = None, log_samples: bool = False,
             bootstrap_iters: int = 1000) -> dict[str, Any] | None:
    """lm-eval's results dict (`results`, `configs`, `n-shot`, ..., `samples` when `log_samples`) of the tasks
    `specs` scored by `lm` (rank 0 holds the results under data parallel; other ranks get None).
    lm-eval's default seeds: few-shot samples are the same in every run and layout. bootstrap_iters: resamples for
    the standard errors of metrics without a closed form (perplexities); lm-eval seeds them, and 0 gives none."""
    from jinja2.sandbox import SecurityError
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    options = options or DownstreamConfig()
    include = list(include_path or [])
    check_include_paths(include, options.trust_task_code)
    with template_environment(options.trust_task_code):
        tasks: list[str | dict[str, Any]] = [lm_eval_config(spec, options) if is_task_file(spec) else spec
                                             for spec in specs]
        # lm-eval's own task index (thousands of YAMLs) is read only when a task is named from it
        manager = TaskManager(include_path=include or None,
                              include_defaults=any(not is_task_file(spec) for spec in specs))
        try:
            with _local_rank_zero(lm.world_size == 1):
                return evaluator.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                                 task_manager=manager, log_samples=log_samples,
                                                 bootstrap_iters=bootstrap_iters)
        except SecurityError as err:  # a template that passed the static checks, refused while rendering
            raise render_error(err, "a task", "a template") or err from None
