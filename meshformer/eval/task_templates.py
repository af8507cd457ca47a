"""The templates of downstream task files (`doc_to_text`, `doc_to_choice`, `doc_to_target` in lm-eval's Jinja), and
the Python functions a trusted task file names with `!function`.

A task file is data: while lm-eval reads and scores it, lm-eval's template environment is swapped for jinja2's
ImmutableSandboxedEnvironment (meshformer/eval/run.py `template_environment`) with only the filters
lm-evaluation-harness' own task templates use (plus its `regex_replace`), `range` as the one global, no attribute
or item whose name starts with "_" (refused when the task file is read, before anything renders), and bounds on what
one rendering may build (string repetition, powers, `%` formatting, padding methods, the rendered text's length).
`downstream.trust_task_code = true` treats the task file as code, as lm-eval does: templates render in lm-eval's
own (unsandboxed) environment, and `!function module.name` loads `name` from `module.py` in the task's folder.
"""

from __future__ import annotations

import importlib.util
import operator
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from meshformer.config import ConfigError
from meshformer.folders import inside

# The filters lm-eval 0.4.13's bundled task templates use (every doc_to_* / template of its tasks/, parsed), and
# the regex_replace filter lm-eval registers itself.
SANDBOX_FILTERS = ("int", "join", "length", "list", "map", "regex_replace", "replace", "string", "trim")
MAX_RENDERED_CHARS = 1 << 20  # one rendered field; a multiple-choice context or choice list is far smaller
MAX_RANGE = 10_000  # range() in a sandboxed template (lm-eval's templates count choices with it)
TRUST_FIX = ("downstream.trust_task_code = true runs it as lm-eval would (templates unsandboxed, !function loaded "
             "from the task's folder): set it only for a task file you trust as code")


class TaskCodeError(ConfigError):
    """A task file that needs code (or reaches Python internals) where the sandbox allows none."""


def _regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    """lm-eval's `regex_replace` filter (lm_eval/utils.py)."""
    return re.sub(pattern, repl, string, count=count)


def _bounded_range(*args: int) -> range:
    values = range(*args)
    if len(values) > MAX_RANGE:
        raise _security(f"range() of {len(values):,} items (at most {MAX_RANGE:,})")
    return values


def _security(what: str) -> Exception:
    from jinja2.sandbox import SecurityError

    return SecurityError(what)


def _check_size(value: Any) -> Any:
    if isinstance(value, str | bytes | list | tuple) and len(value) > MAX_RENDERED_CHARS:
        raise _security(f"a value of {len(value):,} items (at most {MAX_RENDERED_CHARS:,})")
    if isinstance(value, int) and value.bit_length() > 4096:
        raise _security(f"an integer of {value.bit_length():,} bits")
    return value


def _check_replace(text: Any, old: Any, new: Any, *_: Any) -> Any:
    """`text` if replacing `old` by `new` in it stays within the bound (an empty `old` matches between characters)."""
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        matches = text.count(old) if old else len(text) + 1
        if len(text) + matches * max(0, len(new) - len(old)) > MAX_RENDERED_CHARS:
            raise _security(f"a replacement building over {MAX_RENDERED_CHARS:,} characters")
    return text


def _bounded_regex_replace(string: str, pattern: str, repl: str, count: int = 0) -> str:
    matches = sum(1 for _ in re.finditer(pattern, string)) if isinstance(string, str) else 0
    if isinstance(repl, str) and len(repl) * matches > MAX_RENDERED_CHARS:
        raise _security(f"a replacement building over {MAX_RENDERED_CHARS:,} characters")
    return _regex_replace(string, pattern, repl, count)


def _check_join(value: Any, separator: Any) -> Any:
    if hasattr(value, "__len__") and isinstance(separator, str) and \
            len(separator) * len(value) > MAX_RENDERED_CHARS:
        raise _security(f"a join building over {MAX_RENDERED_CHARS:,} characters")
    return value


@cache
def _sandbox() -> Any:
    from jinja2 import StrictUndefined, Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class TaskSandbox(ImmutableSandboxedEnvironment):
        """lm-eval's environment (StrictUndefined, trailing newline kept), sandboxed and bounded."""

        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
            if op == "**" and isinstance(right, int) and abs(right) > 64:
                raise _security(f"a power of {right}")
            for side, other in ((left, right), (right, left)):  # a repetition's result is its length times n
                if op == "*" and isinstance(other, int) and hasattr(side, "__len__") and \
                        len(side) * other > MAX_RENDERED_CHARS:
                    raise _security(f"a repetition of {len(side) * other:,} items (at most {MAX_RENDERED_CHARS:,})")
            if op == "%" and isinstance(left, str):  # '%1000000000d' pads to any width
                widths = [int(w) for w in re.findall(r"%[-+ #0]*(\d+)", left)]
                if widths and max(widths) > MAX_RENDERED_CHARS:
                    raise _security(f"a format width of {max(widths):,}")
            return _check_size({"*": operator.mul, "**": operator.pow, "%": operator.mod}[op](left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            qualname = getattr(__obj, "__qualname__", "")  # the sandbox's str.format wrapper keeps str's name
            if qualname.startswith("str."):
                name = qualname.removeprefix("str.")
                if name in ("format", "format_map"):  # a format spec pads to any width: lm-eval's use none
                    raise _security(f"str.{name}() (use filters or ~ to join text)")
                if any(isinstance(a, int) and a > MAX_RENDERED_CHARS for a in args):  # ljust, center, zfill...
                    raise _security(f"str.{name}() with a size above {MAX_RENDERED_CHARS:,}")
                if name == "replace" and isinstance(getattr(__obj, "__self__", None), str):
                    _check_replace(__obj.__self__, *args)
            return _check_size(super().call(__context, __obj, *args, **kwargs))

    class BoundedTemplate(Template):
        """A rendering that grows past MAX_RENDERED_CHARS stops there (lm-eval calls `render`)."""

        def render(self, *args: Any, **kwargs: Any) -> str:
            pieces, size = [], 0
            for piece in self.generate(*args, **kwargs):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise _security(f"a rendered text over {MAX_RENDERED_CHARS:,} characters")
                pieces.append(piece)
            return "".join(pieces)

    TaskSandbox.template_class = BoundedTemplate
    env = TaskSandbox(undefined=StrictUndefined, keep_trailing_newline=True)
    filters = {name: env.filters[name] for name in SANDBOX_FILTERS if name in env.filters}
    replace, join = filters["replace"], filters["join"]
    # the filters that can grow a text many times over are measured before they build it
    filters["replace"] = lambda ctx, s, old, new, count=None: replace(ctx, _check_replace(s, old, new), old, new,
                                                                       count)
    filters["join"] = lambda ctx, value, d="", attribute=None: _check_size(join(ctx, _check_join(value, d), d,
                                                                                attribute))
    filters["regex_replace"] = _bounded_regex_replace
    for name in ("replace", "join"):
        filters[name].jinja_pass_arg = replace.jinja_pass_arg  # type: ignore[attr-defined]
    env.filters = filters
    env.globals = {"range": _bounded_range}
    return env


@cache
def _trusted() -> Any:
    """lm-eval's own environment (lm_eval/utils.py): a trusted task renders exactly as there."""
    from jinja2 import BaseLoader, Environment, StrictUndefined

    env = Environment(loader=BaseLoader(), undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = _regex_replace
    return env


def check_template(source: str, where: str, key: str, trust: bool) -> None:
    """The template of `key` in the task file `where` parses; in the sandbox, one reaching Python internals or using a
    filter lm-eval's templates do not is refused here, before anything renders."""
    from jinja2 import TemplateSyntaxError, nodes

    env = _trusted() if trust else _sandbox()
    try:
        tree = env.parse(source)
    except TemplateSyntaxError as err:
        raise ConfigError(f"{where}: {key} is not a valid template ({err.message}, template line {err.lineno})",
                          "fix the template (lm-eval's Jinja syntax)") from None
    if not trust:
        for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
            name = node.attr if isinstance(node, nodes.Getattr) else node.name if isinstance(node, nodes.Filter) \
                else node.arg.value if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str) else ""
            if isinstance(node, nodes.Filter) and name not in env.filters:
                raise TaskCodeError(f"{where}: {key} uses the filter {name!r}, which task templates do not have "
                                    f"(they have {', '.join(SANDBOX_FILTERS)})",
                                    f"use one of those, or (for a task file you trust as code) {TRUST_FIX}")
            if name.startswith("_"):
                raise TaskCodeError(f"{where}: {key} reaches Python internals ({name!r}); task templates render in "
                                    "a sandbox that reads the document's fields only", TRUST_FIX)


def render_error(err: Exception, where: str, key: str) -> ConfigError | None:
    """The one line for a sandbox refusal met while rendering `key` (None: not one)."""
    from jinja2.sandbox import SecurityError

    if isinstance(err, SecurityError):
        return TaskCodeError(f"{where}: {key} was refused by the task sandbox ({err})",
                             f"fix the template; for a task file you trust as code, {TRUST_FIX}")
    return None


def load_function(task_dir: Path, name: str, where: str, key: str, follow_links: bool) -> Callable[..., Any]:
    """`!function module.name` as lm-eval reads it: `name` from `<task folder>/module.py` (trusted tasks only)."""
    module_name, _, function = name.strip().rpartition(".")
    fix = "name a function of a .py file in the task's folder: !function utils.process_docs for utils.py"
    if not module_name or not function.isidentifier():
        raise ConfigError(f"{where}: {key} is !function {name!r}, not MODULE.FUNCTION", fix)
    path = inside(task_dir, f"{module_name}.py", what=f"{where}: {key} (!function {name})", fix=fix,
                  follow_links=follow_links)
    if not path.is_file():
        raise ConfigError(f"{where}: {key} is !function {name}, but {path} does not exist", fix)
    spec = importlib.util.spec_from_file_location(f"meshformer_task_code.{module_name}", path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # the task's own code: its failure is the task file's, named in one line
        raise ConfigError(f"{where}: {key}: {path} failed to import ({type(err).__name__}: {err})",
                          "fix that file") from None
    value = getattr(module, function, None)
    if not callable(value):
        raise ConfigError(f"{where}: {key}: {path} has no function {function!r}", fix)
    return value
