"""Reading downstream task files: lm-evaluation-harness' local-task YAML beside its JSONL documents.

A task file is data, never code, unless the user's own config says otherwise (`downstream.trust_task_code`):
- its YAML loads with a safe loader that bounds the file's size and the nodes its aliases and merge keys expand to
  (a kilobyte of nested aliases would otherwise build gigabytes);
- its templates are checked when it is read and render in a sandbox while lm-eval reads and scores it
  (meshformer/eval/task_templates.py); `!function` needs the trust switch;
- its `data_files` are files inside the task's folder: relative paths resolve against the YAML's folder (not
  against the current folder, as lm-eval resolves them); an absolute path, `..` or a link leaving the folder is
  refused (a link is followed with `downstream.follow_links = true`), and so is anything but a regular file;
- its documents hold at most `downstream.max_task_mb`, refused by size before reading; before step 1 each line is
  read as a JSON object and every document rendered (`rendered_docs`).
The task then runs through lm-eval's evaluator as the config dict `lm_eval_config` returns.
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshformer.config import ConfigError
from meshformer.config.sections import DownstreamConfig
from meshformer.eval.task_templates import (
    TRUST_FIX,
    TaskCodeError,
    check_template,
    load_function,
    render_error,
)
from meshformer.folders import inside

BUNDLED_DIR = Path(__file__).with_name("tasks")
MAX_YAML_BYTES = 1 << 20  # a task YAML is a few lines
MAX_YAML_NODES = 100_000  # YAML nodes once aliases and merge keys are expanded


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


def _split_files(data_files: Any) -> dict[str, list[Any]]:
    """datasets' `data_files`: a path or list (split "train") or {split: path or list}."""
    if isinstance(data_files, str | list):
        data_files = {"train": data_files}
    if not isinstance(data_files, dict):
        return {}
    return {split: [files] if isinstance(files, str) else list(files) if isinstance(files, list) else [files]
            for split, files in data_files.items()}


def _records(source: Path, name: str) -> list[tuple[str, dict[str, Any]]]:
    """(where, JSON object) of each line of a JSONL data file (its size already checked): a line that is not UTF-8
    or not a JSON object is named in one line."""
    records = []
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
        elif key in ("target_delimiter", "fewshot_delimiter") and not isinstance(value, str):
            raise ConfigError(f"{where}: {key} is {value!r}, not a string", "write the text that separates them")
        elif key in _TEMPLATE_KEYS and isinstance(value, str):
            check_template(value, where, key, options.trust_task_code)
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
                                   f"downstream.max_task_mb={options.max_task_mb}: a task's documents are read "
                                   "into memory and all scored at every evaluation")
            resolved[str(split)].append(str(source.resolve()))
    config["dataset_kwargs"] = {"data_files": resolved}
    config.setdefault("task", path.stem)
    return config


# the keys lm-eval renders for every document (a string that names a column of the document is read, not rendered)
_RENDERED_KEYS = ("doc_to_text", "doc_to_target", "doc_to_choice")


def rendered_docs(spec: str, options: DownstreamConfig | None = None) -> list[dict[str, Any]]:
    """Every evaluation document of a local task file as lm-eval renders it (`text`, `target`, and `choices` when
    it has doc_to_choice), read as `lm_eval_config` reads it and rendered by lm-eval's own renderer in the sandbox
    unless downstream.trust_task_code (run before step 1, so a refused or ill-fitting template stops the run then):
    a data line that is not a JSON object, a sandbox refusal or a template that does not fit a document is one line
    naming the file, the line and the key."""
    import lm_eval.utils
    from jinja2 import TemplateError
    from lm_eval.api.task import ConfigurableTask

    from meshformer.eval.run import template_environment

    options = options or DownstreamConfig()
    config = lm_eval_config(spec, options)
    name = config["task"]
    records = [record for sources in config["dataset_kwargs"]["data_files"].values() for source in sources
               for record in _records(Path(source), name)]
    with template_environment(options.trust_task_code):
        for key in _RENDERED_KEYS:
            template = config.get(key)
            for where, doc in records if isinstance(template, str) else []:
                if template in doc:
                    continue
                try:
                    lm_eval.utils.apply_template(template, doc)
                except (TemplateError, TypeError, ValueError, RecursionError, MemoryError) as err:
                    raise render_error(err, where, key) or ConfigError(
                        f"{where}: its fields do not fit the task's {key} ({type(err).__name__}: {err})",
                        "fix the document or the task's template") from None
        try:
            task = ConfigurableTask(config=config)
            docs = list(task.eval_docs)
            return [{"text": task.doc_to_text(doc), "target": task.doc_to_target(doc),
                     **({"choices": task.doc_to_choice(doc)} if config.get("doc_to_choice") is not None else {})}
                    for doc in docs]
        except ConfigError:
            raise
        except Exception as err:  # lm-eval's reading of the config, or a trusted task's own code
            raise ConfigError(f"downstream task {task_path(spec)}: lm-eval cannot read it "
                              f"({type(err).__name__}: {err})", "fix the task file") from None
