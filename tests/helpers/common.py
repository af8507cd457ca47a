"""What several test modules (and bench/) share: the repository's folders and a free port for a rendezvous."""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"  # on sys.path (conftest.py), so test modules import `helpers.<name>`
CONFIGS = ROOT / "configs"  # the shipped configs; tests name them through this, whatever the working directory



def load_script(relative: str) -> ModuleType:
    """A script of the repository that is no package module (bench/, tools/), loaded from its file."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A TCP port nobody listens on right now, for a process group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_each(*calls: tuple[Callable[..., Any], tuple]) -> list[Any]:
    """fn(*args) for each (fn, args) in turn: several measurements share one spawned process group, whose start-up
    (a torch import per rank) costs ~10 s on 2 cores."""
    return [fn(*args) for fn, args in calls]


# A small tiny-gpt for trainer runs (overrides of configs/tiny-gpt.toml).
SMALL = ["model.d_model=64", "model.attention.n_heads=4", "model.n_layers=2", "model.ffn.d_ff=256", "data.seq_len=64",
         "model.max_seq_len=64", "train.sample_interval=0", "train.eval_interval=0"]
