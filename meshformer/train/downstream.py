"""Downstream evaluation in the training loop: zero-shot multiple-choice tasks in lm-evaluation-harness' format.

A task is lm-eval's local-task YAML (`dataset_path: json`, `dataset_kwargs: {data_files: ...}`, `doc_to_text` /
`doc_to_choice` / `doc_to_target` as column names, Jinja templates or literal lists) beside its JSONL documents:
nothing is downloaded. Each choice is scored as lm-eval's HFLM scores it: the summed log-likelihood of
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

import ast
import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from meshformer.batch import IGNORE_INDEX, Batch
from meshformer.config import Config, ConfigError
from meshformer.data import Tokenizer
from meshformer.loss.cross_entropy import LossFn
from meshformer.loss.fused import VocabShard
from meshformer.loss.spec import LossSpec
from meshformer.parallel.mesh_model import MultiRankParallelModel
from meshformer.parallel.parallel_model import ParallelModel
from meshformer.parallel.pipeline.stages import TransformerStage
from meshformer.parallel.tensor_parallel import vocab_shard

BUNDLED_DIR = Path(__file__).with_name("downstream_tasks")
# The YAML keys this reader follows; any other key (process_results, filter_list, a few-shot split, ...) is refused.
SUPPORTED_KEYS = ("task", "tag", "dataset_path", "dataset_kwargs", "output_type", "training_split",
                  "validation_split", "test_split", "doc_to_text", "doc_to_choice", "doc_to_target",
                  "target_delimiter", "fewshot_delimiter", "num_fewshot", "description", "metric_list", "metadata")
METRICS = ("acc", "acc_norm", "acc_bytes", "loglik_per_token", "loglik_per_byte")


@dataclass(frozen=True)
class Doc:
    context: str
    choices: list[str]
    gold: int


@dataclass
class Task:
    name: str
    docs: list[Doc]
    target_delimiter: str = " "


@dataclass
class TaskScores:
    """One task's metrics and, per document, the summed log-likelihood of each choice."""

    metrics: dict[str, float]
    logliks: list[list[float]] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- reading tasks


def task_path(spec: str) -> Path:
    """The YAML of a `downstream.tasks` entry: "bundled:NAME" or a path."""
    if spec.startswith("bundled:"):
        path = BUNDLED_DIR / f"{spec.removeprefix('bundled:')}.yaml"
        if not path.is_file():
            names = ", ".join(f"bundled:{p.stem}" for p in sorted(BUNDLED_DIR.glob("*.yaml")))
            raise ConfigError(f"downstream.tasks: no bundled task {spec!r}", f"use one of {names}, or a task YAML path")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"downstream.tasks: task file {spec!r} not found",
                          "give the path of an lm-eval task YAML (or a bundled:NAME task)")
    return path


def load_task(spec: str) -> Task:
    """A task from its YAML and JSONL documents; unsupported lm-eval features are refused naming the key."""
    import yaml

    class Loader(yaml.SafeLoader):
        """lm-eval's tags (`!function module.name`) load as `_Tagged` values, refused below naming their key."""

    Loader.add_multi_constructor("!", lambda loader, tag, node: _Tagged(f"!{tag}"))
    path = task_path(spec)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"downstream task {path}: not valid YAML ({str(err).splitlines()[0]})",
                          "fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"downstream task {path}: not a YAML mapping", "write the task's keys (task, doc_to_text...)")

    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"downstream task {path}: {key} {why}",
                           "in-loop evaluation reads zero-shot multiple-choice tasks from local JSONL files "
                           f"(keys: {', '.join(SUPPORTED_KEYS)})")

    for key, value in raw.items():
        if key not in SUPPORTED_KEYS:
            raise refuse(repr(key), "is not supported")
        if isinstance(value, _Tagged):
            raise refuse(key, f"given as {value.tag} (Python code) is not supported")
    if raw.get("output_type") != "multiple_choice":
        raise refuse("output_type", f"{raw.get('output_type')!r} is not supported (only multiple_choice)")
    if raw.get("dataset_path") != "json":
        raise refuse("dataset_path", f"{raw.get('dataset_path')!r} is not supported (only json: local JSONL files)")
    if raw.get("num_fewshot", 0) not in (0, None):
        raise refuse("num_fewshot", f"{raw['num_fewshot']} is not supported (zero-shot only)")
    if raw.get("description"):
        raise refuse("description", "is not supported")
    for entry in raw.get("metric_list") or []:
        metric = entry.get("metric") if isinstance(entry, dict) else entry
        if metric not in ("acc", "acc_norm", "acc_bytes"):
            raise refuse("metric_list", f"metric {metric!r} is not supported (acc, acc_norm, acc_bytes)")
    kwargs = raw.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) != {"data_files"}:
        raise refuse("dataset_kwargs", f"{kwargs!r} is not supported (only data_files)")
    split = raw.get("test_split") or raw.get("validation_split")
    if not split:
        raise refuse("test_split", "is missing (lm-eval evaluates test_split, else validation_split)")
    files = _split_files(kwargs["data_files"]).get(split)
    if not files:
        raise refuse("dataset_kwargs.data_files", f"has no files for split {split!r}")
    for key in ("doc_to_text", "doc_to_choice", "doc_to_target"):
        if raw.get(key) is None:
            raise refuse(key, "is missing")
    name = str(raw.get("task") or path.stem)
    docs = []
    for file in files:
        source = Path(file) if Path(file).is_absolute() else path.parent / file
        if not source.is_file():
            raise ConfigError(f"downstream task {path}: data file {source} not found",
                              "data_files are read relative to the task YAML's folder")
        for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                where = f"downstream task {name}: {source.name} line {number}"
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{where}: not valid JSON ({err.msg})", "one JSON object per line") from None
                if not isinstance(doc, dict):
                    raise ConfigError(f"{where}: not a JSON object", "one JSON object per line")
                docs.append(_doc(raw, doc, where))
    if not docs:
        raise ConfigError(f"downstream task {path}: no documents in {files}", "add JSONL lines to the data file")
    return Task(name, docs, str(raw.get("target_delimiter", " ")))


@dataclass(frozen=True)
class _Tagged:
    tag: str


def load_tasks(cfg: Config) -> list[Task]:
    """The tasks of downstream.tasks, checked against the run (preflight reads them before any data work)."""
    if cfg.downstream.interval < 0 or cfg.downstream.batch_size < 0:
        raise ConfigError(f"downstream.interval={cfg.downstream.interval} and downstream.batch_size="
                          f"{cfg.downstream.batch_size} must be >= 0", "use 0 for their defaults")
    if not cfg.downstream.tasks:
        return []
    if cfg.objective != "causal":
        raise ConfigError(f"downstream.tasks scores continuations with a causal language model, but this run's "
                          f"objective is {cfg.objective!r}", "remove downstream.tasks for this model")
    tasks = [load_task(spec) for spec in cfg.downstream.tasks]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"downstream.tasks: two tasks are named alike ({names})", "list each task once")
    return tasks


def _split_files(data_files: Any) -> dict[str, list[str]]:
    """datasets' `data_files`: a path or list (split "train") or {split: path or list}."""
    if isinstance(data_files, str | list):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict):
        return {}
    return {split: [files] if isinstance(files, str) else list(files) for split, files in data_files.items()}


def _render(template: str, doc: dict[str, Any]) -> str:
    from jinja2 import BaseLoader, Environment, StrictUndefined

    env = Environment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)  # lm-eval's
    return env.from_string(template).render(**doc)


def _doc(raw: dict[str, Any], doc: dict[str, Any], where: str) -> Doc:
    """lm-eval's doc_to_text / doc_to_choice / doc_to_target: a column name, a template, or a literal."""
    from jinja2 import TemplateError

    try:
        text = raw["doc_to_text"]
        if isinstance(text, str) and text in doc:
            context = doc[text]
        else:  # a rendered digit string is a choice index to lm-eval (multiple-input tasks such as Winogrande)
            context = _render(str(text), doc)
            context = int(context) if context.isdigit() else context
        if not isinstance(context, str):
            raise ConfigError(f"{where}: doc_to_text gives {context!r}, not a context text",
                              "multiple-input tasks (a choice index as the text) are not supported")
        spec = raw["doc_to_choice"]
        if isinstance(spec, list):
            choices = spec
        elif isinstance(spec, dict):
            choices = list(spec.values())
        else:
            choices = doc[spec] if spec in doc else ast.literal_eval(_render(spec, doc))
        target = raw["doc_to_target"]
        if isinstance(target, str):
            if target in doc:
                target = doc[target]
            else:
                target = _render(target, doc)
                target = int(target) if target.isdigit() else target
    except (TemplateError, KeyError, SyntaxError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: its fields do not fit the task's templates ({type(err).__name__}: {err})",
                          "fix the document or the task's doc_to_* keys") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise ConfigError(f"{where}: doc_to_choice gives {choices!r}", "give a non-empty list of strings")
    if isinstance(target, str):
        if target not in choices:
            raise ConfigError(f"{where}: target {target!r} is not one of the choices", "fix the document")
        target = choices.index(target)
    if not isinstance(target, int) or isinstance(target, bool) or not 0 <= target < len(choices):
        raise ConfigError(f"{where}: target {target!r} is not a choice index (0..{len(choices) - 1})",
                          "one target per document (lists of targets are not supported)")
    return Doc(context, choices, target)


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
def _row_losses(model: ParallelModel, cfg: Config) -> Iterator[_RowLosses]:
    """The layout's loss replaced by per-row plain cross-entropy (full logits, this rank's vocabulary shard under
    tensor parallel) while scoring."""
    shard = None
    if isinstance(model, MultiRankParallelModel) and model.dims.tp_enabled:
        shard = VocabShard(model.meshes.tp.get_group(), vocab_shard(cfg.model, model.meshes.tp)[0],
                           cfg.model.vocab_size)
    recorder = _RowLosses(LossSpec("plain").bind(shard).logits_loss)
    stages = [part for part in model.model_parts if isinstance(part, TransformerStage)]
    saved = model.loss_fn, model.head_loss, [stage.head_loss for stage in stages]
    model.loss_fn, model.head_loss = recorder, None
    for stage in stages:
        stage.head_loss = None
    try:
        yield recorder
    finally:
        model.loss_fn, model.head_loss = saved[0], saved[1]
        for stage, head_loss in zip(stages, saved[2]):
            stage.head_loss = head_loss


def _reports_rows(model: ParallelModel) -> bool:
    """Whether this rank's row losses count in the sum: the last pipeline stage's first tensor-parallel rank (each
    context-parallel rank holds a part of every row's tokens, each data-parallel rank its own rows)."""
    if isinstance(model, MultiRankParallelModel):
        return model.reports_loss and model.meshes.tp_rank == 0
    return True


@torch.no_grad()
def score_rows(model: ParallelModel, cfg: Config, rows: list[tuple[list[int], list[int]]], batch_size: int,
               pad_id: int, seq_len: int) -> list[float]:
    """The summed log-likelihood of each row's labelled tokens, identical on every rank (a collective).

    Each data-parallel rank scores every dp-th row; every rank runs the same number of batches (rows of padding
    carry no labels), so the layout's collectives line up. A batch is as long as its longest row (rounded up)."""
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
        with _row_losses(model, cfg) as recorder:
            for b in range(n_batches):
                picked = mine[b * batch_size:(b + 1) * batch_size]
                length = padded_length(max((len(rows[i][0]) for i in picked), default=1), seq_len, multiple)
                ids = torch.full((batch_size, length), pad_id, dtype=torch.long)
                labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
                for row, i in enumerate(picked):  # right padding: a causal model's scores ignore what follows
                    ids[row, :len(rows[i][0])] = torch.tensor(rows[i][0])
                    labels[row, :len(rows[i][1])] = torch.tensor(rows[i][1])
                batch: Batch = {"input_ids": ids.to(model.device), "labels": labels.to(model.device)}
                recorder.rows.clear()
                model.evaluate(batch)
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

    def run(self, model: ParallelModel) -> dict[str, float]:
        """Every task's metrics as `downstream/<task>/<metric>` scalars (the same on every rank)."""
        start = time.perf_counter()
        logliks = score_rows(model, self.cfg, self.rows, self.batch_size, self.pad_id, self.cfg.data.seq_len)
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

