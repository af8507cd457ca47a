"""Checkpoint files on their own: manifests, atomic commit, retention, pickle-free loading, RNG as JSON."""

from __future__ import annotations

import json
import os
import pickle
import random
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshformer.checkpointing import CorruptCheckpointError
from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.commit import commit, partial_dir
from meshformer.checkpointing.dcp_io import SafeFileSystemReader, SafeLoadPlanner, read_full_tensors, save_tensors
from meshformer.checkpointing.directory import committed_steps, read_latest, step_dir_name, steps_to_delete
from meshformer.checkpointing.manifest import verify_manifest
from meshformer.checkpointing.rng import capture_rng_state, restore_rng_state


def _committed(root, step: int, tensors: dict[str, torch.Tensor]):
    partial = partial_dir(root, step)
    save_tensors(tensors, partial)
    (partial / "trainer_state.json").write_text(json.dumps({"step": step}))
    return commit(partial, step)


def test_commit_writes_manifest_then_renames_then_points_latest(tmp_path):
    tensors = {"a": torch.arange(1000.0), "b": torch.ones(3, 3)}
    folder = _committed(tmp_path, 7, tensors)
    assert folder == tmp_path / step_dir_name(7) and not partial_dir(tmp_path, 7).exists()
    assert read_latest(tmp_path) == step_dir_name(7)
    manifest = verify_manifest(folder)
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "trainer_state.json"}
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in manifest["files"].values())
    loaded = read_full_tensors(folder)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "no_manifest", "bad_manifest"])
def test_damage_is_detected(tmp_path, damage):
    folder = _committed(tmp_path, 1, {"w": torch.randn(64, 64)})
    shard = folder / "__0_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-10] ^= 0x80
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        os.truncate(shard, shard.stat().st_size - 1)
    elif damage == "delete":
        shard.unlink()
    elif damage == "no_manifest":
        (folder / "manifest.json").unlink()
    else:
        (folder / "manifest.json").write_text("{\"format\": \"meshformer-checkpoint\", \"files\": ")
    with pytest.raises(CorruptCheckpointError):
        verify_manifest(folder)
    if damage == "flip":
        verify_manifest(folder, "size")  # the cheap mode only sees sizes: it passes, sha256 is what catches flips


def test_retention_policy():
    steps = list(range(100, 1100, 100))
    assert steps_to_delete(steps, keep_last=2, keep_every=0) == steps[:-2]
    assert steps_to_delete(steps, keep_last=2, keep_every=500) == [100, 200, 300, 400, 600, 700, 800]
    assert steps_to_delete(steps, keep_last=0, keep_every=0) == []  # 0 keeps everything


def test_only_committed_folders_count(tmp_path):
    _committed(tmp_path, 3, {"x": torch.zeros(2)})
    partial_dir(tmp_path, 9).mkdir()
    (tmp_path / "step-00000010.corrupt-123").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    assert committed_steps(tmp_path) == [3]


def _malicious_pickle(marker) -> bytes:
    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    return pickle.dumps(Payload())


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path):
    folder = tmp_path / "ckpt"
    save_tensors({"w": torch.ones(2)}, folder)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(_malicious_pickle(marker))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        read_full_tensors(folder)
    assert not marker.exists()


def test_non_tensor_entries_load_with_weights_only(tmp_path):
    """DCP's default planner would torch.load(weights_only=False) a non-tensor entry and run its payload."""
    folder, marker = tmp_path / "ckpt", tmp_path / "pwned"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "blob": _PickledPayload(marker)}, checkpoint_id=str(folder), no_dist=True)
    state = {"w": torch.zeros(2), "blob": None}
    with pytest.raises(dcp.CheckpointException, match="unsupported GLOBAL"):  # weights_only refused it
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()


class _PickledPayload:
    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(capture_rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    restore_rng_state(state)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert expected[0] == again[0] and expected[1] == again[1] and torch.equal(expected[2], again[2])


def _tiny_run(tmp_path, step: int, *overrides: str):
    from meshformer.checkpointing import Checkpointable, SchedulerState, TrainState
    from meshformer.config import load_config
    from meshformer.model import Transformer

    cfg = load_config(None, ["model.d_model=16", "model.attention.n_heads=2", "model.n_layers=1", "model.ffn.d_ff=32",
                             "model.vocab_size=64", "checkpoint.interval=1", f'checkpoint.dir="{tmp_path}"',
                             *overrides])
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Checkpointable(TrainState(step=step), [model], optimizer, {"scheduler": SchedulerState(scheduler)}, cfg)


def test_retention_never_deletes_the_checkpoint_just_written(tmp_path):
    """Steps 900/1000 from another run are in the folder; a new save at step 100 must survive retention."""
    from meshformer.checkpointing import CheckpointManager

    _committed(tmp_path, 900, {"x": torch.zeros(2)})
    _committed(tmp_path, 1000, {"x": torch.zeros(2)})
    run = _tiny_run(tmp_path, 100, "checkpoint.keep_last=1", "checkpoint.keep_every=0")
    manager = CheckpointManager.from_config(run.config, tmp_path)
    manager.save(run, blocking=True)
    manager.close()
    assert 100 in committed_steps(tmp_path)
    latest = read_latest(tmp_path)
    assert latest == step_dir_name(100) and (tmp_path / latest).is_dir()
    verify_manifest(tmp_path / latest)


def test_newer_manifest_version_stops_instead_of_being_moved_aside(tmp_path):
    from meshformer.checkpointing import CheckpointManager

    folder = _committed(tmp_path, 5, {"x": torch.zeros(2)})
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "version": manifest["version"] + 1}))
    with pytest.raises(CheckpointError, match="newer meshformer") as info:
        verify_manifest(folder)
    assert not isinstance(info.value, CorruptCheckpointError)
    run = _tiny_run(tmp_path, 0)
    manager = CheckpointManager.from_config(run.config, tmp_path)
    try:
        with pytest.raises(CheckpointError, match="upgrade meshformer"):
            manager.resume(run)
    finally:
        manager.close()
    assert committed_steps(tmp_path) == [5] and not list(tmp_path.glob("*.corrupt-*"))


def test_a_component_without_state_is_an_error_not_a_skip(tmp_path):
    """A loader without state_dict/load_state_dict would resume from its start: refused when the run is assembled."""
    from meshformer.checkpointing import Checkpointable

    run = _tiny_run(tmp_path, 0)

    class Stateless:
        def __iter__(self):
            return iter(())

    with pytest.raises(CheckpointError, match=r"component 'data' \(Stateless\) has no state_dict"):
        Checkpointable(run.state, run.model_parts, run.optimizer, {"data": Stateless()}, run.config)


def test_resume_needs_the_state_of_every_component(tmp_path):
    """A checkpoint saved without a data position cannot silently restart this run's data from the beginning."""
    from meshformer.checkpointing import Checkpointable, CheckpointManager, TrainState

    saved = _tiny_run(tmp_path, 3)
    manager = CheckpointManager.from_config(saved.config, tmp_path)
    manager.save(saved, blocking=True)

    class Position:
        def __init__(self) -> None:
            self.consumed = 0

        def state_dict(self) -> dict:
            return {"consumed": self.consumed}

        def load_state_dict(self, state: dict) -> None:
            self.consumed = state["consumed"]

    fresh = _tiny_run(tmp_path, 0)
    components = {**fresh.components, "data": Position()}
    wanting = Checkpointable(TrainState(), fresh.model_parts, fresh.optimizer, components, fresh.config)
    try:
        with pytest.raises(CheckpointError, match="holds no state for 'data'"):
            manager.resume(wanting)
        assert wanting.state.step == 0
        assert manager.resume(fresh) and fresh.state.step == 3  # the same components: resumes
    finally:
        manager.close()
