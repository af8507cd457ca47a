"""The trainer's set-up reads as one sequence (meshformer/train/setup.py).

Counted from the code: every meshformer function, method, constructor or property that the set-up code calls
directly (`Trainer.__init__` and the bodies of the set-up steps, which count as set-up code so a step cannot hide
its calls), in call order, each placed at its package's layer in the import-linter contract (pyproject.toml). A
*climb* is a call into a higher layer than the call before it: the set-up going back up the package's layers after
it had gone down. Calls into the set-up code itself (the steps, the typed pieces they return) are its structure,
not a visit, and are left out.
"""

from __future__ import annotations

import itertools
import re
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

from helpers.checkpoints import tiny_config, tiny_shards

import meshformer.train.setup as setup
from meshformer.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
# The most climbs the set-up may make (14 before it was split into steps): most are where a step starts higher than
# the last one ended; the failure message shows the sequence.
MAX_CLIMBS = 11


def _layers() -> list[list[str]]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layered,) = [c for c in contracts if c["type"] == "layers"]
    return [[name.strip() for name in entry.split("|")] for entry in layered["layers"]]


def _layer(module: str, layers: list[list[str]]) -> int | None:
    """0 for the top layer; None outside meshformer's layers."""
    for index, names in enumerate(layers):
        if any(module == name or module.startswith(name + ".") for name in names):
            return index
    return None


def _codes(function: Any) -> set[types.CodeType]:
    """A function's code and the code nested in it (comprehensions, lambdas)."""
    found, todo = set(), [function.__code__]
    while todo:
        code = todo.pop()
        found.add(code)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return found


def _setup_code() -> set[types.CodeType]:
    code = _codes(Trainer.__init__)
    for value in vars(setup).values():
        if isinstance(value, types.FunctionType) and value.__module__ == setup.__name__:
            code |= _codes(value)
    return code


def traced_setup(cfg) -> tuple[list[tuple[str, int]], list[str]]:
    """Build a Trainer, recording the set-up's direct calls as (module.qualname, layer) and the set-up steps that
    `Trainer.__init__` called, in order."""
    layers, own = _layers(), _setup_code()
    init = Trainer.__init__.__code__
    calls: list[tuple[str, int]] = []
    steps: list[str] = []

    def profile(frame, event, arg):
        caller = frame.f_back
        if event != "call" or caller is None or caller.f_code not in own:
            return
        module = frame.f_globals.get("__name__", "")
        if frame.f_code in own or module == setup.__name__:  # a step, or the typed piece a step returns
            if caller.f_code is init and module == setup.__name__ and frame.f_code in own:
                steps.append(frame.f_code.co_name)
            return
        layer = _layer(module, layers)
        if layer is not None:
            calls.append((f"{module}.{frame.f_code.co_qualname}", layer))

    sys.setprofile(profile)
    try:
        Trainer(cfg)
    finally:
        sys.setprofile(None)
    return calls, steps


def climbs(calls: list[tuple[str, int]]) -> int:
    return sum(1 for (_, before), (_, now) in itertools.pairwise(calls) if now < before)


def test_climbs_counts_calls_into_a_higher_layer():
    assert climbs([("a", 3), ("b", 6), ("c", 10), ("d", 5), ("e", 5), ("f", 3)]) == 2
    assert climbs([("a", 3), ("b", 5), ("c", 5), ("d", 10)]) == 0


def test_the_set_up_is_one_sequence(tmp_path, one_thread):
    calls, steps = traced_setup(tiny_config(tiny_shards(tmp_path), tmp_path / "run", 2))
    listed = re.findall(r"^\d+\. `(\w+)`", setup.__doc__ or "", flags=re.M)
    # Trainer.__init__ runs the steps the module lists, in its order; restore_state runs at fit
    assert steps == [s for s in listed if s != "restore_state"], steps
    assert len(calls) > 20  # the trace saw the set-up's calls
    sequence = "\n".join(f"{layer:3d} {name}{'  <- climb' if i and layer < calls[i - 1][1] else ''}"
                         for i, (name, layer) in enumerate(calls))
    assert climbs(calls) <= MAX_CLIMBS, f"the set-up climbs the layers {climbs(calls)} times:\n{sequence}"

