"""A replica group without a quorum (fewer than fault_tolerance.min_replicas groups, or no Lighthouse) waits with one
line, then goes on when the quorum is back, or gives up after fault_tolerance.wait_s with one line naming the fix."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust side starts (meshformer's require_torchft)
pytest.importorskip("torchft")

from meshformer.config.sections import FaultToleranceConfig
from meshformer.runtime.fault_tolerance import FaultToleranceError, ReplicaGroup, start_lighthouse

CFG = FaultToleranceConfig(enabled=True, replica_groups=2, min_replicas=2, timeout_s=10, quorum_timeout_s=0.5,
                           join_timeout_s=0.2, heartbeat_timeout_s=1)


def _group(cfg: FaultToleranceConfig, replica: int, lines: list[str]) -> ReplicaGroup:
    return ReplicaGroup(cfg, replica, torch.device("cpu"), state_dict=dict, load_state_dict=lambda state: None,
                        log=lines.append)


def test_a_group_below_min_replicas_waits_then_goes_on_when_the_other_comes():
    lighthouse = start_lighthouse(CFG, bind="127.0.0.1:0")
    # each ask lasts longer than the other group's pause between asks, so two waiting groups' asks overlap
    cfg = replace(CFG, lighthouse=lighthouse.address(), quorum_timeout_s=2.0)
    lines: list[str] = []
    late: list[ReplicaGroup] = []
    errors: list[BaseException] = []

    def second_group() -> None:
        time.sleep(2.0)
        try:
            late.append(group := _group(cfg, 1, []))
            group.start_step_or_wait(wait_s=30)  # as a group does: its first ask may miss the other's ask
        except BaseException as err:  # reported by the test below
            errors.append(err)

    first = _group(cfg, 0, lines)
    thread = threading.Thread(target=second_group)
    try:
        thread.start()
        waited = first.start_step_or_wait(wait_s=30)
        thread.join(30)
        assert errors == []
        assert 1.5 < waited < 30, waited
        assert first.participants == 2
        assert len(lines) == 2, lines
        assert lines[0].startswith("fault tolerance: replica group 0 has no quorum (") and "wait_s=30s" in lines[0]
        assert lines[1].startswith("fault tolerance: replica group 0 has a quorum again after "), lines
    finally:
        for group in (first, *late):
            group.shutdown()
        lighthouse.shutdown()


def test_a_group_without_a_quorum_gives_up_after_wait_s():
    lighthouse = start_lighthouse(CFG, bind="127.0.0.1:0")
    lines: list[str] = []
    group = _group(replace(CFG, lighthouse=lighthouse.address()), 0, lines)
    try:
        start = time.perf_counter()
        with pytest.raises(FaultToleranceError, match=r"replica group 0 had no quorum for \d+s \(fault_tolerance"
                                                      r".wait_s=1\.5\)"):
            group.start_step_or_wait(wait_s=1.5)
        assert time.perf_counter() - start >= 1.5
        assert len(lines) == 1 and "has no quorum" in lines[0], lines
    finally:
        group.shutdown()
        lighthouse.shutdown()



def test_a_lost_lighthouse_is_noticed_and_waited_for_until_it_is_back_at_the_same_address():
    """The Lighthouse stops listening after a quorum: the next step waits with a line (not the last quorum again),
    and goes on once a Lighthouse listens at the same address again."""
    one = replace(CFG, replica_groups=1, min_replicas=1)
    lighthouse = start_lighthouse(one, bind="127.0.0.1:0")
    address = lighthouse.address()
    lines: list[str] = []
    group = _group(replace(one, lighthouse=address), 0, lines)
    restarted: list = []

    def restart() -> None:
        time.sleep(2.0)
        restarted.append(start_lighthouse(one, bind="127.0.0.1:" + address.rsplit(":", 1)[1]))

    try:
        group.start_step_or_wait(wait_s=30)
        assert group.should_commit() and lines == []
        lighthouse.shutdown()
        thread = threading.Thread(target=restart)
        thread.start()
        waited = group.start_step_or_wait(wait_s=30)
        thread.join(30)
        assert 1.5 < waited < 30, waited
        assert group.should_commit()
        assert len(lines) == 2, lines
        assert "has no quorum (" in lines[0] and f"the Lighthouse at {address} cannot be reached" in lines[0], lines
        assert "has a quorum again after" in lines[1], lines
    finally:
        group.shutdown()
        for server in restarted:
            server.shutdown()
