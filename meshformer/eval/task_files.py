"""Reading downstream task files: lm-evaluation-harness' local-task YAML beside its JSONL documents.

A task file is data, never code, unless the user's own config says otherwise (`downstream.trust_task_code`):
- its YAML loads with a safe loader that bounds the file's size and the nodes its aliases and merge keys expand to
  (a kilobyte of nested aliases would otherwise build gigabytes);
- its templates render in a sandbox (meshformer/eval/task_templates.py); `!function` needs the trust switch;
- its `data_files` are files inside the task's folder: relative paths resolve against the YAML's folder (not
  against the current folder, as lm-eval resolves them); an absolute path, `..` or a link leaving the folder is
  refused (a link is followed with `downstream.follow_links = true`), and so is anything but a regular file;
- its documents are read line by line up to `downstream.max_task_mb`, refused by size before reading.
"""

from __future__ import annotations

import ast
import json
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshformer.config import Config, ConfigError
from meshformer.config.sections import DownstreamConfig
from meshformer.eval.task_templates import (
    TRUST_FIX,
    TaskCodeError,
    Template,
    compile_template,
    load_function,
    render_error,
)
from meshformer.folders import inside

BUNDLED_DIR = Path(__file__).with_name("tasks")
# The YAML keys this reader follows; any other key (process_results, filter_list, include, a few-shot split, ...)
# is refused.
SUPPORTED_KEYS = ("task", "tag", "dataset_path", "dataset_kwargs", "output_type", "training_split",
                  "validation_split", "test_split", "doc_to_text", "doc_to_choice", "doc_to_target",
                  "target_delimiter", "fewshot_delimiter", "num_fewshot", "description", "metric_list", "metadata",
                  "process_docs")
FUNCTION_KEYS = ("doc_to_text", "doc_to_choice", "doc_to_target", "process_docs")  # may be !function (trusted)
MAX_YAML_BYTES = 1 << 20  # a task YAML is a few lines
MAX_YAML_NODES = 100_000  # YAML nodes once aliases and merge keys are expanded


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


@dataclass(frozen=True)
class _Tagged:
    """A YAML value written with a tag (`!function utils.f`)."""

    tag: str
    value: str


def task_path(spec: str) -> Path:
    """The YAML of a `downstream.tasks` entry: "bundled:NAME" or a path."""
    if spec.startswith("bundled:"):
        path = BUNDLED_DIR / f"{spec.removeprefix('bundled:')}.yaml"
        if not path.is_file():
            names = ", ".join(f"bundled:{p.stem}" for p in sorted(BUNDLED_DIR.glob("*.yaml")))
            raise ConfigError(f"downstream.tasks: no bundled task {spec!r}", f"use one of {names}, or a task YAML path")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(f"downstream.tasks: task file {spec!r} not found",
                          "give the path of an lm-eval task YAML (or a bundled:NAME task)")
    _regular_file(path, f"downstream.tasks: task file {spec!r}", MAX_YAML_BYTES, "a task YAML is a few lines")
    return path


def _regular_file(path: Path, what: str, limit: int, why: str) -> int:
    """The size of `path`, a regular file of at most `limit` bytes; anything else is refused saying what it is."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{what} is {_kind(info.st_mode)}, not a regular file", "point it at a regular file")
    if info.st_size > limit:
        raise ConfigError(f"{what} holds {info.st_size:,} bytes, over the limit of {limit:,} ({why})",
                          "check that it is the file you meant")
    return info.st_size


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "a special file")


def _yaml(path: Path) -> Any:
    """The task YAML, loaded safely and bounded: tags become `_Tagged`, refused or resolved by their key."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_document(self) -> Any:
            node = super().compose_document()
            _expanded_nodes(node, {}, set())
            return node

    Loader.add_multi_constructor("!", lambda loader, tag, node: _Tagged(
        f"!{tag}", str(loader.construct_scalar(node)) if isinstance(node, yaml.ScalarNode) else ""))
    try:
        return yaml.load(path.read_bytes().decode("utf-8"), Loader=Loader)  # a SafeLoader; size checked by task_path
    except UnicodeDecodeError as err:
        raise ConfigError(f"downstream task {path}: not UTF-8 text (byte {err.object[err.start]:#04x} at byte "
                          f"offset {err.start})", "save the task YAML as UTF-8") from None
    except _AliasBomb as err:
        raise ConfigError(f"downstream task {path}: its aliases expand to {err} (at most {MAX_YAML_NODES:,} "
                          "nodes)", "write the values out: a task YAML needs no nested aliases") from None
    except (yaml.YAMLError, RecursionError) as err:
        first = str(err).splitlines()[0] if str(err) else "nested too deeply"
        raise ConfigError(f"downstream task {path}: not valid YAML ({first})", "fix the file") from None


class _AliasBomb(Exception):
    pass


def _expanded_nodes(node: Any, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many nodes `node` stands for once every alias is written out; an alias bomb or a recursive alias stops
    the count at MAX_YAML_NODES (each node is counted once: linear in the file)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _AliasBomb("an alias that holds itself")
    open_nodes.add(key)
    children: list[Any] = []
    if isinstance(node.value, list):
        for item in node.value:
            children.extend(item if isinstance(item, tuple) else (item,))
    total = 1
    for child in children:
        total += _expanded_nodes(child, sizes, open_nodes)
        if total > MAX_YAML_NODES:
            raise _AliasBomb(f"over {MAX_YAML_NODES:,} nodes")
    open_nodes.discard(key)
    sizes[key] = total
    return total


def load_task(spec: str, options: DownstreamConfig | None = None) -> Task:
    """A task from its YAML and JSONL documents; unsupported lm-eval features are refused naming the key."""
    options = options or DownstreamConfig()
    path = task_path(spec)
    raw = _yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"downstream task {path}: not a YAML mapping", "write the task's keys (task, doc_to_text...)")
    where = f"downstream task {path}"

    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where}: {key} {why}",
                           "in-loop evaluation reads zero-shot multiple-choice tasks from local JSONL files "
                           f"(keys: {', '.join(SUPPORTED_KEYS)})")

    functions: dict[str, Callable[..., Any]] = {}
    for key, value in raw.items():
        if key not in SUPPORTED_KEYS:
            raise refuse(repr(key), "is not supported")
        if isinstance(value, _Tagged):
            if value.tag != "!function" or key not in FUNCTION_KEYS:
                raise refuse(key, f"given as {value.tag} is not supported (!function in {', '.join(FUNCTION_KEYS)})")
            if not options.trust_task_code:
                raise TaskCodeError(f"{where}: {key} is !function {value.value} (Python code in the task's folder)",
                                    TRUST_FIX)
            functions[key] = load_function(path.parent, value.value, where, key, options.follow_links)
        elif key == "process_docs":
            raise refuse(key, "is supported as !function only")
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
    for key in ("target_delimiter", "fewshot_delimiter"):
        if not isinstance(raw.get(key, ""), str):
            raise refuse(key, f"is {raw[key]!r}, not a string")
    kwargs = raw.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) != {"data_files"}:
        raise refuse("dataset_kwargs", f"{kwargs!r} is not supported (only data_files)")
    split = raw.get("test_split") or raw.get("validation_split")
    if not split or not isinstance(split, str):
        raise refuse("test_split", "is missing (lm-eval evaluates test_split, else validation_split)")
    files = _split_files(kwargs["data_files"]).get(split)
    if not files:
        raise refuse("dataset_kwargs.data_files", f"has no files for split {split!r}")
    for key in ("doc_to_text", "doc_to_choice", "doc_to_target"):
        if raw.get(key) is None:
            raise refuse(key, "is missing")
    templates = {key: compile_template(raw[key], where, key, options.trust_task_code)
                 for key in ("doc_to_text", "doc_to_choice", "doc_to_target")
                 if isinstance(raw[key], str) and key not in functions}
    name = str(raw.get("task") or path.stem)
    records = _documents(path, files, name, options)
    if "process_docs" in functions:
        records = _process_docs(functions["process_docs"], records, where)
    docs = [_doc(raw, record, label, templates, functions) for label, record in records]
    if not docs:
        raise ConfigError(f"{where}: no documents in {files}", "add JSONL lines to the data file")
    return Task(name, docs, str(raw.get("target_delimiter", " ")))


def load_tasks(cfg: Config) -> list[Task]:
    """The tasks of downstream.tasks, checked against the run (preflight reads them before any data work)."""
    if cfg.downstream.interval < 0 or cfg.downstream.batch_size < 0:
        raise ConfigError(f"downstream.interval={cfg.downstream.interval} and downstream.batch_size="
                          f"{cfg.downstream.batch_size} must be >= 0", "use 0 for their defaults")
    if cfg.downstream.max_task_mb <= 0:
        raise ConfigError(f"downstream.max_task_mb={cfg.downstream.max_task_mb} must be positive",
                          "give the most MiB of JSONL documents one task may hold (default 64)")
    if not cfg.downstream.tasks:
        return []
    if cfg.objective != "causal":
        raise ConfigError(f"downstream.tasks scores continuations with a causal language model, but this run's "
                          f"objective is {cfg.objective!r}", "remove downstream.tasks for this model")
    tasks = [load_task(spec, cfg.downstream) for spec in cfg.downstream.tasks]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"downstream.tasks: two tasks are named alike ({names})", "list each task once")
    return tasks


def _split_files(data_files: Any) -> dict[str, list[Any]]:
    """datasets' `data_files`: a path or list (split "train") or {split: path or list}."""
    if isinstance(data_files, str | list):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict):
        return {}
    return {split: [files] if isinstance(files, str) else list(files) if isinstance(files, list) else [files]
            for split, files in data_files.items()}


def _documents(path: Path, files: list[Any], name: str, options: DownstreamConfig) -> list[tuple[str, Any]]:
    """(where, JSON object) of each JSONL line of `files`, each a regular file inside the task's folder, all of them
    within downstream.max_task_mb (checked before any is read)."""
    limit = options.max_task_mb << 20
    fix = ("data_files are files in the task YAML's folder, named relative to it (not to the current folder, as "
           "lm-eval reads them): copy the file there; downstream.follow_links = true reads a link that leaves it")
    sources = [inside(path.parent, file, what=f"downstream task {path}: dataset_kwargs.data_files", fix=fix,
                      follow_links=options.follow_links) for file in files]
    total = 0
    for source in sources:
        if not source.exists():
            raise ConfigError(f"downstream task {path}: data file {source} not found",
                              "data_files are read relative to the task YAML's folder")
        why = (f"downstream.max_task_mb={options.max_task_mb}: a task's documents are read into memory and all "
               "scored at every evaluation")
        total += _regular_file(source, f"downstream task {path}: data file {source}", limit - total, why)
    records = []
    for source in sources:
        with open(source, "rb") as fh:  # line by line, and never past what was measured
            for number, line in enumerate(fh, start=1):
                where = f"downstream task {name}: {source.name} line {number}"
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ConfigError(f"{where}: not UTF-8 text (byte {line[err.start]:#04x} at column "
                                      f"{err.start + 1})", "save the task's JSONL as UTF-8") from None
                if not text.strip():
                    continue
                try:
                    doc = json.loads(text)
                except (json.JSONDecodeError, RecursionError) as err:
                    msg = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
                    raise ConfigError(f"{where}: not valid JSON ({msg})", "one JSON object per line") from None
                if not isinstance(doc, dict):
                    raise ConfigError(f"{where}: not a JSON object", "one JSON object per line")
                records.append((where, doc))
    return records


def _process_docs(function: Callable[..., Any], records: list[tuple[str, Any]], where: str) -> list[tuple[str, Any]]:
    """lm-eval's `process_docs`: the function takes the split as a `datasets.Dataset` and returns one."""
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{where}: process_docs needs the datasets package",
                          'pip install datasets (or "meshformer[eval]")') from None
    try:
        processed = function(datasets.Dataset.from_list([doc for _, doc in records]))
        docs = [dict(doc) for doc in processed]
    except Exception as err:  # the task's own code
        raise ConfigError(f"{where}: process_docs failed ({type(err).__name__}: {err})",
                          "fix the task's process_docs function") from None
    return [(f"{where}: document {i} after process_docs", doc) for i, doc in enumerate(docs)]


def _field(raw: dict[str, Any], key: str, doc: dict[str, Any], templates: dict[str, Template],
           functions: dict[str, Callable[..., Any]]) -> tuple[Any, bool]:
    """lm-eval's doc_to_* value: a function's result, a column, a rendered template, or the literal given; and
    whether it was rendered."""
    if key in functions:
        return functions[key](doc), False
    spec = raw[key]
    if isinstance(spec, str) and spec in doc:
        return doc[spec], False
    if key in templates:
        return templates[key].render(doc), True
    return spec, False


def _doc(raw: dict[str, Any], doc: dict[str, Any], where: str, templates: dict[str, Template],
         functions: dict[str, Callable[..., Any]]) -> Doc:
    """lm-eval's doc_to_text / doc_to_choice / doc_to_target: a column name, a template, a literal or a function."""
    from jinja2 import TemplateError

    key = "doc_to_text"
    try:
        context, rendered = _field(raw, key, doc, templates, functions)
        if rendered and context.isdigit():  # a choice index to lm-eval (multiple-input tasks such as Winogrande)
            context = int(context)
        if not isinstance(context, str):
            raise ConfigError(f"{where}: doc_to_text gives {context!r}, not a context text",
                              "multiple-input tasks (a choice index as the text) are not supported")
        key = "doc_to_choice"
        choices, rendered = _field(raw, key, doc, templates, functions)
        if rendered:
            choices = ast.literal_eval(choices)
        elif isinstance(raw[key], dict):
            choices = list(choices.values())
        key = "doc_to_target"
        target, rendered = _field(raw, key, doc, templates, functions)
        if rendered and target.isdigit():
            target = int(target)
    except ConfigError:
        raise
    except (TemplateError, KeyError, SyntaxError, ValueError, TypeError, RecursionError, MemoryError) as err:
        if (refusal := render_error(err, where, key)) is not None:
            raise refusal from None
        if key in functions:
            raise ConfigError(f"{where}: {key} failed ({type(err).__name__}: {err})",
                              "fix the task's function") from None
        raise ConfigError(f"{where}: its fields do not fit the task's templates ({type(err).__name__}: {err})",
                          "fix the document or the task's doc_to_* keys") from None
    except Exception as err:  # a trusted task's own function
        if key not in functions:
            raise
        raise ConfigError(f"{where}: {key} failed ({type(err).__name__}: {err})", "fix the task's function") from None
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



# lm-eval keys whose value is read as another file or as code by lm-eval itself: a dict config cannot confine them
_LM_EVAL_REFUSED = ("include", "dataset_name", "custom_dataset", "class")
# lm-eval keys it renders as Jinja templates: checked by the sandbox's rules before anything renders
_TEMPLATE_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice", "description", "gen_prefix",
                  "doc_to_decontamination_query", "fewshot_delimiter", "target_delimiter")


def lm_eval_config(spec: str, options: DownstreamConfig | None = None) -> dict[str, Any]:
    """A local task YAML ("bundled:NAME" or a path) as the config dict lm-eval's evaluator takes, read as data: the
    YAML bounded and safe, `data_files` confined to the task's folder and resolved there, their size within
    downstream.max_task_mb, `!function` loaded only under downstream.trust_task_code (its templates render in the
    sandbox unless trusted: `meshformer.eval.run.template_environment`)."""
    options = options or DownstreamConfig()
    path = task_path(spec)
    raw = _yaml(path)
    where = f"downstream task {path}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: not a YAML mapping", "write the task's keys (task, doc_to_text...)")
    config: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _LM_EVAL_REFUSED:
            raise ConfigError(f"{where}: {key} is not supported in a task file read as data",
                              "write the task's keys out in one YAML, or list its folder in --include-path with "
                              "downstream.trust_task_code = true")
        if isinstance(value, _Tagged):
            if value.tag != "!function":
                raise ConfigError(f"{where}: {key} is given as {value.tag}", "only !function tags are read")
            if not options.trust_task_code:
                raise TaskCodeError(f"{where}: {key} is !function {value.value} (Python code in the task's folder)",
                                    TRUST_FIX)
            value = load_function(path.parent, value.value, where, key, options.follow_links)
        elif key in _TEMPLATE_KEYS and isinstance(value, str):
            compile_template(value, where, key, options.trust_task_code)
        config[key] = value
    if config.get("dataset_path") != "json":
        raise ConfigError(f"{where}: dataset_path {config.get('dataset_path')!r} is not a local file format",
                          "use dataset_path: json with data_files beside the YAML, or name a registry task")
    kwargs = config.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict) or set(kwargs) != {"data_files"}:
        raise ConfigError(f"{where}: dataset_kwargs {kwargs!r} is not supported (only data_files)",
                          "name the JSONL files in data_files")
    files = _split_files(kwargs["data_files"])
    fix = ("data_files are files in the task YAML's folder, named relative to it (not to the current folder, as "
           "lm-eval reads them): copy the file there; downstream.follow_links = true reads a link that leaves it")
    total, limit = 0, options.max_task_mb << 20
    resolved: dict[str, list[str]] = {}
    for split, names in files.items():
        resolved[str(split)] = []
        for name in names:
            source = inside(path.parent, name, what=f"{where}: dataset_kwargs.data_files", fix=fix,
                            follow_links=options.follow_links)
            if not source.exists():
                raise ConfigError(f"{where}: data file {source} not found",
                                  "data_files are read relative to the task YAML's folder")
            total += _regular_file(source, f"{where}: data file {source}", limit - total,
                                   f"downstream.max_task_mb={options.max_task_mb}")
            resolved[str(split)].append(str(source.resolve()))
    config["dataset_kwargs"] = {"data_files": resolved}
    config.setdefault("task", path.stem)
    return config
