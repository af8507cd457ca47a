"""Training-loop callbacks: what the loop does besides training, in hooks a user's class can join.

The trainer (meshformer.train.trainer) runs the steps; everything else it does each step is a `Callback`
(meshformer.train.builtin_callbacks): step metrics and their sinks, held-out evaluation, decoded samples,
checkpoint cadence, profiling, straggler and MoE statistics. A user's callback is added from the config
(`[[callbacks]]` with `path = "pkg.module:Class"` and `args = {...}`) or from Python (`Trainer(cfg, callbacks=[...])`).

Hooks, in the order a run calls them. Each gets the run's one `CallbackContext` (`ctx`); in the per-step hooks
`ctx.step` is the step being trained (1-based).

- `on_run_start(ctx)`: after the resume (or the HF init), before this run's first step; `ctx.step` is the steps
  already taken. Reads: the trainer, its model and config. Changes: its own state.
- `on_step_start(ctx)`: before the step's batches are loaded. Changes: nothing the step reads (batches, weights).
- `on_optimizer_step(ctx, applied)`: after the optimizer update, before the scheduler moves; `applied` is a device
  tensor, 1.0 where the update was applied, 0.0 where an inf/nan gradient skipped it. Reads: the updated weights.
  Changes: weights, identically on every rank holding them (as the FP8 scale and router-bias hooks do).
- `on_step_end(ctx)`: after the step. Reads: `ctx.stats` (loss sum, tokens, grad norm, lr); on logging steps
  (`ctx.log_step`) `ctx.metrics`. Changes: `ctx.metrics`, which the metrics logger (order 90) writes to
  metrics.jsonl, TensorBoard and W&B: numbers (a 0-d tensor is read as its float, a host sync); anything else
  stops the run with one line naming the key and the callback.
- `on_evaluation(ctx)`: the step's evaluation point (not reached when a stop signal ends the run at this step);
  each evaluation keeps its own interval (`ctx.every(n)`). Reads: the model (in train mode: switch modes back).
  Changes: nothing training reads; scalars go out through `ctx.log(...)`.
- `on_checkpoint(ctx)`: the step's checkpoint point, after its metrics are on disk (not reached at a stop: the
  final save follows). `ctx.saved` is the folder the checkpoint cadence (order 40) saved at this step, else None
  (an asynchronous save commits later). Changes: its own state.
- `on_run_end(ctx)`: after the final checkpoint and weights, or after the save of a stop signal; `ctx.saved` is the
  final checkpoint, if any. Changes: nothing training reads.

Rules: callbacks run in ascending `order` (ties: the order they were given, built-ins first). Built-ins: step
metrics 10, straggler report 20, MoE statistics 30, checkpoint cadence 40, held-out loss 10, samples 20, metrics
logger 90, profiler 95; user callbacks default to 50. They run on the ranks they declare (`ranks`: "all", "zero",
or a tuple of global ranks); a callback that issues collectives (all-reduce, barrier) must run on every rank.
Training reads nothing a callback writes unless the callback changes weights or the optimizer, so the loss curve
and a resume's weights stay those of a run without it. A callback with state gives `state_dict()` (plain JSON)
and `load_state_dict()`: the state rank 0 holds is saved in every checkpoint (trainer_state.json, component
"callbacks") and restored on every rank at resume, so such a callback must run on rank 0.

A user's callback that fails (raises, `SystemExit` included, in a hook, at import or in its constructor) stops the
run with one line naming it (`callbacks[i]` and its path), where it failed and the exception; its traceback is kept
in `<run_dir>/diagnostics/callback-rank<R>.txt`. Only a stop signal passes through a hook as what it is.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import numbers
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.config import Config, ConfigError
from meshformer.config.sections import CallbackConfig
from meshformer.data.corpus_base import short
from meshformer.errors import MeshformerError
from meshformer.runtime.stop import StopAgreed

if TYPE_CHECKING:
    from meshformer.train.step import StepStats
    from meshformer.train.trainer import Trainer

Ranks = str | tuple[int, ...]  # "all", "zero", or global ranks
USER_ORDER = 50  # where a callback that says nothing runs: after the step metrics, before they are written
HOOKS = ("on_run_start", "on_step_start", "on_optimizer_step", "on_step_end", "on_evaluation", "on_checkpoint",
         "on_run_end")


@dataclass
class CallbackContext:
    """What every hook is given: the trainer and the step's results. One object for the whole run."""

    trainer: Trainer
    step: int = 0  # the step being trained (1-based); on_run_start: steps already taken; on_run_end: steps taken
    stats: StepStats | None = None  # the step's StepStats (device tensors: reading one is a host sync)
    log_step: bool = False  # whether this step logs metrics (logging.log_interval, and the last step)
    metrics: dict[str, float] = field(default_factory=dict)  # this step's scalars, filled on logging steps
    stopping: bool = False  # a stop signal ends the run after this step (evaluation is skipped)
    saved: Path | None = None  # on_checkpoint / on_run_end: the checkpoint folder saved at this step, if any
    loss: float = float("nan")  # the last logged training loss
    eval_loss: float | None = None  # the last held-out loss
    history: list[dict[str, float]] = field(default_factory=list)  # every logged step's scalars

    @property
    def cfg(self) -> Config:
        return self.trainer.cfg

    @property
    def rank(self) -> int:
        return self.trainer.rank

    @property
    def last(self) -> bool:
        """This is the run's last step (train.steps)."""
        return self.step == self.cfg.train.steps

    def every(self, interval: int, *, last: bool = False) -> bool:
        """Whether an every-`interval`-steps task runs at this step (interval 0: never; `last`: also the last)."""
        return interval > 0 and (self.step % interval == 0 or (last and self.last))

    def log(self, scalars: dict[str, float]) -> None:
        """Write scalars at this step to metrics.jsonl, TensorBoard and W&B (rank 0's logger writes); numbers, a 0-d
        tensor read as its float."""
        values = {}
        for key, value in scalars.items():
            number = scalar(value)
            if number is None:
                raise ConfigError(f"ctx.log was given {_kind(value)} for {key!r}", SCALAR_FIX)
            values[key] = number
        self.trainer.logger.scalars(self.step, values)

    def info(self, message: str) -> None:
        """A console line (rank 0)."""
        self.trainer.logger.info(message)


class Callback:
    """A training-loop callback: override the hooks you need (every hook is a no-op here). See the module notes."""

    order: ClassVar[int] = USER_ORDER  # ascending: lower runs first
    ranks: ClassVar[Ranks] = "all"  # where it runs: "all", "zero" (rank 0 only), or a tuple of global ranks
    phase: ClassVar[str] = ""  # what a hang report names while it runs; "": "callback <name>"

    @property
    def name(self) -> str:
        """Its key in the checkpoint's callback state."""
        return type(self).__name__

    def on_run_start(self, ctx: CallbackContext) -> None:
        pass

    def on_step_start(self, ctx: CallbackContext) -> None:
        pass

    def on_optimizer_step(self, ctx: CallbackContext, applied: torch.Tensor) -> None:
        pass

    def on_step_end(self, ctx: CallbackContext) -> None:
        pass

    def on_evaluation(self, ctx: CallbackContext) -> None:
        pass

    def on_checkpoint(self, ctx: CallbackContext) -> None:
        pass

    def on_run_end(self, ctx: CallbackContext) -> None:
        pass


def has_state(callback: Callback) -> bool:
    return callable(getattr(callback, "state_dict", None))


def runs_on(ranks: Ranks, rank: int) -> bool:
    if ranks == "all":
        return True
    if ranks == "zero":
        return rank == 0
    return rank in tuple(ranks)


def _overrides(callback: Callback, hook: str) -> bool:
    return getattr(type(callback), hook) is not getattr(Callback, hook)


class CallbackError(MeshformerError, RuntimeError):
    """A user's callback failed: in a hook, at import or in its constructor."""


SCALAR_FIX = "put numbers there (a float, an int, or a 0-d tensor, read as its float)"


def scalar(value: Any) -> float | int | None:
    """A metric's value as JSON, TensorBoard and W&B take it, or None when it is not one number."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.ndim == 0 and not value.is_complex() else None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    if isinstance(value, numbers.Real):  # numpy scalars
        return float(value)
    return None


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__} ({' '.join(repr(value).split())[:60]})"


def user_label(callback: Any) -> str:
    """How a one-line error names a callback given from Python (a config's is `callbacks[i] (path)`)."""
    cls = type(callback)
    return f"the callback {cls.__name__} ({cls.__module__}:{cls.__qualname__})"


def callback_failed(label: str, where: str, err: BaseException, diagnostics: Path | None, rank: int | None = None,
                    fix: str = "fix the callback or remove it from [[callbacks]]") -> CallbackError:
    """The one line for a failed callback; its traceback goes to `diagnostics`/callback-rank<R>.txt."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    kept = ""
    if diagnostics is not None:
        path = Path(diagnostics) / f"callback-rank{rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{label} raised {where}:\n" + "".join(traceback.format_exception(err)))
            kept = f" (traceback in {path})"
        except OSError:
            pass
    message = short(err) if str(err) else ""
    raised = f"{type(err).__name__}: {message}" if message else type(err).__name__
    return CallbackError(f"{label} raised {where}: {raised}{kept}", fix)


class Callbacks:
    """A run's callbacks in their order, called on the ranks they declare; `state` is their checkpoint component
    (None when none of them has state). `labels`: the user's callbacks (by id) and how an error names them; their
    failures become one line, with the traceback in `diagnostics`."""

    def __init__(self, callbacks: Sequence[Callback], rank: int,
                 on_phase: Callable[[str], None] = lambda name: None, *, labels: Mapping[int, str] | None = None,
                 diagnostics: Path | None = None) -> None:
        for callback in callbacks:
            _check_declaration(callback)
        ordered = [c for _, c in sorted(enumerate(callbacks), key=lambda ic: (ic[1].order, ic[0]))]
        self.all = ordered
        self.active = [c for c in ordered if runs_on(c.ranks, rank)]
        self._on_phase = on_phase
        self._labels = dict(labels or {})
        self._diagnostics, self._rank = diagnostics, rank
        # per hook, only the callbacks that override it: a hook nobody joins costs nothing per step
        self._by_hook = {hook: [c for c in self.active if _overrides(c, hook)] for hook in HOOKS}
        stateful = [c for c in ordered if has_state(c)]
        self.state = CallbackState(stateful, rank) if stateful else None

    def wants(self, hook: str) -> bool:
        return bool(self._by_hook[hook])

    def call(self, hook: str, ctx: CallbackContext, *args: Any) -> None:
        for callback in self._by_hook[hook]:
            self._on_phase(callback.phase or f"callback {callback.name}")
            label = self._labels.get(id(callback))
            if label is None:  # a built-in: its errors are the run's own
                getattr(callback, hook)(ctx, *args)
                continue
            before = dict(ctx.metrics)  # what this callback adds is checked (the logger writes it at step end)
            try:
                getattr(callback, hook)(ctx, *args)
            except (StopAgreed, KeyboardInterrupt):  # a stop (or Ctrl-C without the stop handlers) is no failure
                raise
            except BaseException as err:  # SystemExit too: a callback does not end the run without its save
                raise callback_failed(label, f"in {hook}", err, self._diagnostics, self._rank,
                                      self._fix(label)) from err
            self._check_metrics(ctx.metrics, before, label, hook)

    @staticmethod
    def _fix(label: str) -> str:
        if label.startswith("callbacks["):
            return "fix the callback or remove it from [[callbacks]]"
        return "fix the callback or leave it out of the trainer's callbacks"

    def _check_metrics(self, metrics: dict[str, Any], before: dict[str, Any], label: str, hook: str) -> None:
        for key, value in metrics.items():
            if key in before and before[key] is value:
                continue
            number = scalar(value)
            if number is None:
                raise CallbackError(f"{label} put {_kind(value)} in ctx.metrics[{key!r}] in {hook}", SCALAR_FIX)
            metrics[key] = number


class CallbackState:
    """The state of the stateful callbacks, by name, as one checkpoint component (rank 0's is saved)."""

    def __init__(self, callbacks: Sequence[Callback], rank: int) -> None:
        self.by_name: dict[str, Callback] = {}
        for callback in callbacks:
            if not callable(getattr(callback, "load_state_dict", None)):
                raise ConfigError(f"callback {callback.name} has state_dict() but no load_state_dict()",
                                  "give it both, so that a resume restores its state")
            if not runs_on(callback.ranks, 0):
                raise ConfigError(f"callback {callback.name} has state but does not run on rank 0 (ranks="
                                  f"{callback.ranks!r}); checkpoints save rank 0's callback state",
                                  "let it run on rank 0 too, or keep its state out of state_dict()")
            name, n = callback.name, 2
            while name in self.by_name:  # two of one class: numbered in their order
                name, n = f"{callback.name}#{n}", n + 1
            self.by_name[name] = callback
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.by_name.items()  # type: ignore[attr-defined]
                if runs_on(c.ranks, self.rank)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, callback in self.by_name.items():
            if not runs_on(callback.ranks, self.rank):
                continue
            if name not in state_dict:
                raise CheckpointError(f"the checkpoint holds no state for callback {name} (saved by a run without "
                                      "it); resume with the callbacks it was saved with, or start a new run")
            callback.load_state_dict(state_dict[name])  # type: ignore[attr-defined]


def _check_declaration(callback: Callback) -> None:
    if not isinstance(callback, Callback):
        raise ConfigError(f"{callback!r} is not a meshformer.train.callbacks.Callback",
                          "subclass Callback and override the hooks you need")
    ranks = callback.ranks
    if not (ranks in ("all", "zero") or (isinstance(ranks, tuple) and all(isinstance(r, int) for r in ranks))):
        raise ConfigError(f"callback {callback.name} declares ranks={ranks!r}",
                          'use "all", "zero" or a tuple of global ranks')


def import_callback_module(module_name: str, folder: str) -> ModuleType:
    """The module a [[callbacks]] path names. Its top-level module or package comes from `folder` (the config file's,
    `CallbackConfig.folder`) when it is there, else from sys.path as any import. Only that name is looked up in the
    folder: the folder is not put on sys.path, so its other files shadow nothing the run imports."""
    top = module_name.partition(".")[0]
    here = Path(folder) if folder and top.isidentifier() else None
    found = next((f for f in (here / top / "__init__.py", here / f"{top}.py") if f.is_file()), None) if here else None
    if found is not None:
        loaded = sys.modules.get(top)
        if loaded is None:
            package = [str(found.parent)] if found.name == "__init__.py" else None
            spec = importlib.util.spec_from_file_location(top, found, submodule_search_locations=package)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[top] = module  # before it runs, as an import does: its own imports may name it
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[top]
                raise
        elif Path(getattr(loaded, "__file__", None) or "").resolve() != found.resolve():
            raise ConfigError(f"callback module {found} has the name of the module {top!r} the run already imported "
                              f"({getattr(loaded, '__file__', 'built in')})", "rename your module")
    return importlib.import_module(module_name)


def loaded_line(callback: Callback) -> str:
    """The console line confirming a user callback: where its class came from, its ranks and order."""
    cls = type(callback)
    ranks = callback.ranks if isinstance(callback.ranks, str) else ",".join(map(str, callback.ranks))
    return f"callbacks: loaded {cls.__module__}:{cls.__qualname__} (ranks {ranks}, order {callback.order})"


def callback_class(entry: CallbackConfig, where: str, diagnostics: Path | None = None) -> type[Callback]:
    """The class a [[callbacks]] table names, with its arguments checked against the constructor; a module that
    fails as it is imported is the callback's failure (its traceback in `diagnostics`)."""
    module_name, sep, class_name = entry.path.partition(":")
    example = 'path = "my_package.my_module:MyCallback"'
    if not sep or not module_name or not class_name:
        raise ConfigError(f"{where}.path = {entry.path!r} is not \"module:ClassName\"", f"write e.g. {example}")
    # importlib takes a leading dot as a relative import, and a file path is no module name
    if not all(part.isidentifier() for part in module_name.split(".")) or not class_name.isidentifier():
        raise ConfigError(f"{where}.path = {entry.path!r} is not \"module:ClassName\" with a module's dotted name "
                          "(no leading dot, no file path)",
                          f"write e.g. {example}, the module beside the config file or on PYTHONPATH")
    try:
        module = import_callback_module(module_name, entry.folder)
    except ImportError as err:
        beside = f" (not in {entry.folder} either)" if entry.folder else ""
        raise ConfigError(f"{where}.path = {entry.path!r}: cannot import {module_name!r} ({err}){beside}",
                          "put the module beside the config file, set the table's folder, or install it or put its "
                          "folder on PYTHONPATH (every rank imports it)") from None
    except (KeyboardInterrupt, MeshformerError):  # Ctrl-C; the lookup's own one-line refusals
        raise
    except BaseException as err:  # a syntax error, an exception or SystemExit in the module's own code
        raise callback_failed(f"{where} ({entry.path})", f"at import of {module_name}", err, diagnostics) from err
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        what = "is not a Callback subclass" if cls is not None else "not found"
        raise ConfigError(f"{where}.path = {entry.path!r}: {class_name!r} {what} in {module_name}",
                          "name a subclass of meshformer.train.callbacks.Callback")
    if not isinstance(entry.args, dict):
        raise ConfigError(f"{where}.args must be a table of keyword arguments, got {entry.args!r}",
                          "write e.g. args = {every = 10}")
    try:
        inspect.signature(cls).bind(**entry.args)
    except TypeError as err:
        raise ConfigError(f"{where}.args do not fit {class_name}: {err}",
                          f"give the keyword arguments {class_name}() takes") from None
    return cls


def diagnostics_dir(cfg: Config) -> Path:
    """Where a failed callback's traceback is kept: the run folder's diagnostics/ (as hang reports)."""
    return Path(cfg.logging.run_dir) / "diagnostics"


def config_callbacks(cfg: Config) -> list[Callback]:
    """The callbacks of the config's [[callbacks]] tables, built (a mistake is a one-line error)."""
    return [callback for _, callback in labelled_config_callbacks(cfg)]


def labelled_config_callbacks(cfg: Config) -> list[tuple[str, Callback]]:
    """The callbacks of the config's [[callbacks]] tables, built, each with how an error names it (a mistake, or
    a constructor that raises, is one line)."""
    built = []
    for i, entry in enumerate(cfg.callbacks):
        where = f"callbacks[{i}]"
        cls = callback_class(entry, where, diagnostics_dir(cfg))
        label = f"{where} ({entry.path})"
        try:
            callback = cls(**entry.args)
        except KeyboardInterrupt:
            raise
        except BaseException as err:
            raise callback_failed(label, "in its constructor", err, diagnostics_dir(cfg)) from err
        built.append((label, callback))
    return built


def check_config_callbacks(cfg: Config) -> None:
    """Preflight: every [[callbacks]] path imports and names a Callback taking its args (nothing is built)."""
    for i, entry in enumerate(cfg.callbacks):
        callback_class(entry, f"callbacks[{i}]", diagnostics_dir(cfg))
