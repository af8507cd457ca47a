"""A heal's state transfer (checkpointing/live_state.py): a fresh trainer that takes a live trainer's state through a
serialised copy, as torchft's transport sends it, holds the same weights, optimizer state (Muon's momentum and AdamW's
moments), step, schedule, data position and RNG streams, and trains on in lockstep with it, bit for bit."""

from __future__ import annotations

import io

import pytest
import torch
from helpers.checkpoints import tiny_config, tiny_shards

from meshformer.checkpointing.live_state import live_state, load_live_state
from meshformer.checkpointing.state import training_tensors
from meshformer.train.trainer import Trainer


def _sent(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)  # torchft's HTTPTransport streams the same object with torch's serialiser
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _everything(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in training_tensors(trainer.parallel_model.model_parts,
                                                               trainer.optimizer).items()}


@pytest.mark.slow  # two trainers, five steps
def test_a_healed_trainer_trains_on_in_lockstep_with_its_peer(tmp_path):
    """Muon: its momentum buffers for the matrices, AdamW's moments for the rest."""
    shards = tiny_shards(tmp_path)
    optim = "muon"
    cfg = tiny_config(shards, tmp_path / "peer", 6, f"optim.name={optim}")
    peer = Trainer(cfg)
    peer.train_iter = iter(peer.train_data)
    for _ in range(3):
        peer.train_step()
    healed = Trainer(tiny_config(shards, tmp_path / "healed", 6, f"optim.name={optim}"))
    sent = _sent(live_state(peer.checkpointable))
    rng = torch.get_rng_state()
    torch.rand(7)  # the RNG moves on in this process; the heal puts it back where the peer's stood
    load_live_state(healed.checkpointable, sent)
    assert torch.equal(torch.get_rng_state(), rng)

    ours, theirs = _everything(healed), _everything(peer)
    assert ours.keys() == theirs.keys()
    assert any(k.endswith(".momentum_buffer") for k in ours) and any(k.endswith(".exp_avg") for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert healed.step == peer.step == 3 and healed.train_data.consumed == peer.train_data.consumed
    assert healed.scheduler.last_epoch == peer.scheduler.last_epoch

    # The same batches, learning rates and updates from here on.
    healed.train_iter = iter(healed.train_data)
    for _ in range(2):
        a, b = peer.train_step(), healed.train_step()
        assert torch.equal(a.loss_sum, b.loss_sum) and a.lr == b.lr
    ours, theirs = _everything(healed), _everything(peer)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
