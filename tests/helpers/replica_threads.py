"""Replica groups as threads of the test's process, each with its own torchft Manager, around an in-process
Lighthouse (torchft must be importable)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from meshformer.config.sections import FaultToleranceConfig
from meshformer.runtime.fault_tolerance import ReplicaGroup, start_lighthouse


def run_groups(cfg: FaultToleranceConfig, work: Callable[[ReplicaGroup, int], Any], groups: int = 2) -> list[Any]:
    """`work(group, replica)` in one thread per replica group; its results by replica. The groups' own state is
    not handed over in a heal (empty state dicts): `work` checks what its own pieces carry."""
    lighthouse = start_lighthouse(cfg, bind="127.0.0.1:0")
    cfg = replace(cfg, lighthouse=lighthouse.address())
    results: list[Any] = [None] * groups
    errors: list[BaseException] = []

    def run(replica: int) -> None:
        group = ReplicaGroup(cfg, replica, torch.device("cpu"), state_dict=dict, load_state_dict=lambda state: None,
                             log=print)
        try:
            results[replica] = work(group, replica)
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)
        finally:
            group.shutdown()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(groups)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        lighthouse.shutdown()
    if errors:
        raise errors[0]
    assert all(not thread.is_alive() for thread in threads), "a group did not finish"
    return results
