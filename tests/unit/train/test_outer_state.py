"""DiLoCo's outer state (train/replica_step.py OuterState): the weights of the last synchronisation and the outer
Nesterov momentum go into a checkpoint and come back from it, and a heal hands them to the healed group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

os.environ.setdefault("RUST_LOG", "warn")  # before torchft's Rust side starts (meshformer's require_torchft)
pytest.importorskip("torchft")

from helpers.replica_threads import run_groups

from meshformer.config.sections import FaultToleranceConfig
from meshformer.runtime.fault_tolerance import ReplicaGroup, SemiSync
from meshformer.train.replica_step import OuterState

CFG = FaultToleranceConfig(enabled=True, replica_groups=2, min_replicas=2, method="diloco", sync_every=3,
                           timeout_s=30, quorum_timeout_s=30, join_timeout_s=5)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


class _Anchor:
    """Stands in for SemiSync: the host copies of the weights torchft's DiLoCo keeps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.kept = {id(p): torch.zeros_like(p.detach()) for p in model.parameters()}

    def anchor(self) -> dict[int, torch.Tensor]:
        return self.kept


def _outer_step(state: OuterState, model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    state.outer.step()
    state.outer.zero_grad()


def test_the_outer_state_round_trips_through_a_checkpoint(tmp_path):
    """Saved mid-run and loaded into a fresh group's state: the same anchor and momentum, so the next outer steps
    of both move the weights alike, bit for bit."""
    model = _model()
    state = OuterState(CFG, [model])
    kept = _Anchor(model)
    state.attach(kept)  # type: ignore[arg-type]
    for i, tensor in enumerate(kept.kept.values()):
        tensor.copy_(torch.full_like(tensor, float(i + 1)))
    _outer_step(state, model, seed=1)  # momentum now
    saved = state.tensors()
    assert {k.split(".")[0] for k in saved} == {"anchor", "momentum"} and len(saved) == 8
    dcp.save(saved, checkpoint_id=str(tmp_path), no_dist=True)

    fresh_model = _model()
    fresh_model.load_state_dict(model.state_dict())
    fresh = OuterState(CFG, [fresh_model])
    assert fresh.tensors() == {} and not fresh.resumed
    templates = fresh.load_templates(set(saved))
    dcp.load(templates, checkpoint_id=str(tmp_path), no_dist=True)
    fresh.loaded(set(templates))
    assert fresh.resumed
    fresh_kept = _Anchor(fresh_model)
    fresh.attach(fresh_kept)  # type: ignore[arg-type]  # the group's DiLoCo takes the loaded anchor
    assert all(torch.equal(a, b) for a, b in zip(kept.kept.values(), fresh_kept.kept.values()))
    for seed in (2, 3):
        _outer_step(state, model, seed)
        _outer_step(fresh, fresh_model, seed)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))


def test_a_heal_hands_the_outer_state_to_the_healed_group():
    """Two groups (threads) around an in-process Lighthouse: group 1 starts behind and heals from group 0 at the
    quorum; it then holds group 0's anchor and outer momentum."""
    def work(group: ReplicaGroup, replica: int) -> tuple[dict, dict, float | None]:
        model = _model()
        state = OuterState(CFG, [model])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        semi = SemiSync(CFG, group, [model], optimizer, outer=state.outer)
        state.attach(semi)
        if replica == 0:  # a group some synchronisations in: an anchor and a momentum of its own
            group.manager.load_state_dict({"step": 2, "batches_committed": 0})
            gen = torch.Generator().manual_seed(5)
            for tensor in semi.anchor().values():
                tensor.copy_(torch.randn(tensor.shape, generator=gen))
            _outer_step(state, model, seed=6)
        before = {k: v.clone() for k, v in state.tensors().items()}
        group.start_step()  # group 1 heals here
        seen = (before, {k: v.clone() for k, v in state.tensors().items()}, group.healed_s)
        semi.sync()  # the step's synchronisation, which the heal's peer waits for
        return seen

    seen = run_groups(CFG, work)
    (peer, _, peer_healed), (own, healed, healed_s) = seen
    assert peer_healed is None and healed_s is not None
    assert not any(k.startswith("momentum.") for k in own)  # a fresh group: no momentum until the heal
    assert healed.keys() == peer.keys() and any(k.startswith("momentum.") for k in peer)
    assert all(torch.equal(healed[k], peer[k]) for k in peer), [k for k in peer if not torch.equal(healed[k], peer[k])]
