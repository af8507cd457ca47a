"""Semi-synchronous replica groups (fault_tolerance.method local_sgd / diloco) on torchft: two groups as two threads
of this process, each with its own torchft Manager, around an in-process Lighthouse."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust side starts (meshformer's require_torchft)
pytest.importorskip("torchft")

from helpers.replica_threads import run_groups

from meshformer.config.sections import FaultToleranceConfig
from meshformer.runtime.fault_tolerance import ReplicaGroup, SemiSync

GROUPS = 2
LR = 0.1


_BUILD = threading.Lock()  # the groups' threads share torch's global RNG


def _model() -> torch.nn.Module:
    with _BUILD:
        torch.manual_seed(0)  # every group starts from the same weights
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * replica + step)  # each group its own data
    return torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)


def _backward(model: torch.nn.Module, replica: int, step: int) -> None:
    x, y = _batch(replica, step)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _run_groups(cfg: FaultToleranceConfig, work: Callable[[ReplicaGroup, int], Any]) -> list[Any]:
    return run_groups(cfg, work, GROUPS)


def _cfg(**kw: Any) -> FaultToleranceConfig:
    return FaultToleranceConfig(enabled=True, replica_groups=GROUPS, min_replicas=GROUPS, timeout_s=30,
                                quorum_timeout_s=30, join_timeout_s=5, **kw)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_local_sgd_every_step_equals_sync():
    """With SGD, averaging the weights after each group's own step (local_sgd, H=1) is the step on the averaged
    gradient (sync): the same weights after 3 steps, in both groups."""
    steps = 3

    def sync(group: ReplicaGroup, replica: int) -> list[torch.Tensor]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(steps):
            group.start_step()
            _backward(model, replica, step)
            group.average_gradients(model.parameters(), torch.tensor(1.0))
            assert group.should_commit()
            optimizer.step()
            optimizer.zero_grad()
        return _params(model)

    def local_sgd(group: ReplicaGroup, replica: int) -> list[torch.Tensor]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        semi = SemiSync(group.cfg, group, [model], optimizer)
        for step in range(steps):
            _backward(model, replica, step)
            optimizer.step()
            optimizer.zero_grad()
            assert semi.due(step + 1)
            group.start_step()
            assert group.members() == (0, 1)
            assert semi.sync()
        return _params(model)

    synced = _run_groups(_cfg(), sync)
    local = _run_groups(_cfg(method="local_sgd", sync_every=1), local_sgd)
    for replica in range(GROUPS):
        for a, b in zip(synced[replica], local[replica]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(local[0], local[1])), "the groups' weights differ after a sync"
    assert not torch.equal(synced[0][0], _params(_model())[0]), "the weights never moved"


def test_diloco_outer_step_is_nesterov_on_the_averaged_pseudo_gradient():
    """DiLoCo, H=2, two windows: each sync moves the last synchronised weights by Nesterov SGD (outer_lr,
    outer_momentum) on the groups' mean change, computed here by hand from each group's weights before the sync."""
    h, windows, outer_lr, momentum = 2, 2, 0.7, 0.9

    def diloco(group: ReplicaGroup, replica: int) -> dict[str, list[list[torch.Tensor]]]:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        semi = SemiSync(group.cfg, group, [model], optimizer)
        seen: dict[str, list[list[torch.Tensor]]] = {"local": [], "synced": []}
        step = 0
        for _ in range(windows):
            for _ in range(h):
                _backward(model, replica, step)
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                assert semi.due(step) == (step % h == 0)
            seen["local"].append(_params(model))
            group.start_step()
            assert semi.sync()
            seen["synced"].append(_params(model))
        return seen

    results = _run_groups(_cfg(method="diloco", sync_every=h, outer_lr=outer_lr, outer_momentum=momentum), diloco)
    weights = _params(_model())
    buffers = [torch.zeros_like(w) for w in weights]
    for window in range(windows):
        expected = []
        for i, w in enumerate(weights):
            delta = sum(w - results[r]["local"][window][i] for r in range(GROUPS)) / GROUPS
            buffers[i] = momentum * buffers[i] + delta if window else delta.clone()
            expected.append(w - outer_lr * (delta + momentum * buffers[i]))
        for replica in range(GROUPS):
            for got, want in zip(results[replica]["synced"][window], expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(results[0]["synced"][window], results[1]["synced"][window]))
        weights = expected
