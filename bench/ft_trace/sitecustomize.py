"""Start-up timestamps of every process of a replica-group run, for bench/fault_tolerance_rejoin.py.

Python imports this file at start-up when its folder is on PYTHONPATH (the bench puts it there for its own runs
only). Each process prints `TRACE <unix time> <pid> <role> <event>` lines to stderr: when the process was created
(from /proc), when this file ran (the interpreter is up), when chosen modules finished importing, and when chosen
functions of the trainer's set-up and of the replica step start and end. Nothing else changes.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import time


def _role() -> str:
    argv = " ".join(sys.argv) + " " + " ".join(getattr(sys, "orig_argv", []))
    if "meshformer.launcher.torchrun" in argv:
        return "agent"
    if "meshformer.train" in argv or "meshformer.launcher.warm_rank" in argv:  # a warm rank becomes a rank
        return "rank"
    return "launcher"


ROLE = f"{_role()}{os.environ.get('MESHFORMER_REPLICA_ID', '')}"


def trace(event: str, at: float | None = None) -> None:
    print(f"TRACE {at if at is not None else time.time():.3f} {os.getpid()} {ROLE} {event}", file=sys.stderr,
          flush=True)


def _created() -> float | None:
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None


created = _created()
if created is not None:
    trace("process created", created)
trace("interpreter up")

MODULES = {"torch", "torchft", "meshformer.train.trainer", "meshformer.train.setup",
           "meshformer.runtime.fault_tolerance", "torch.distributed.run"}
# (module, qualified name) of functions whose start and end are traced
FUNCTIONS = {
    "meshformer.train.trainer": ["Trainer.__init__", "Trainer.fit"],
    "meshformer.train.setup": ["restore_state", "load_live_state"],
    "meshformer.runtime.fault_tolerance": ["ReplicaGroup.__init__", "ReplicaGroup.start_step_or_wait"],
    "meshformer.train.replica_step": ["ReplicaTraining.after_step"],
    "torch.distributed.distributed_c10d": ["init_process_group"],
}


def _wrap(module, qualname: str) -> None:
    owner, *rest = qualname.split(".")
    target = getattr(module, owner, None)
    if target is None:
        return
    holder, name = (target, rest[0]) if rest else (module, owner)
    original = getattr(holder, name)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        trace(f"{qualname} start")
        try:
            return original(*args, **kwargs)
        finally:
            trace(f"{qualname} end")

    setattr(holder, name, traced)


class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in MODULES and name not in FUNCTIONS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            if name in MODULES:
                trace(f"import {name} start")
            execute(module)
            if name in MODULES:
                trace(f"import {name} end")
            for qualname in FUNCTIONS.get(name, []):
                _wrap(module, qualname)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, Finder())
