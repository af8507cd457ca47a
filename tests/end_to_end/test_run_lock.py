"""One writer per run folder (#25): a second run is refused in one line naming the first, a commit never replaces a
committed checkpoint, a size-only resume says so, a full disk at the final weights is one line, and final/ is
replaced only when it is ours."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.checkpoints import (
    assert_bitwise,
    final_weights,
    reference_files,
    run_trainer,
    tiny_config,
    tiny_overrides,
    tiny_shards,
)
from helpers.common import CONFIGS, ROOT

from meshformer.checkpointing import CheckpointError
from meshformer.checkpointing.commit import commit, partial_dir
from meshformer.checkpointing.dcp_io import read_full_tensors
from meshformer.checkpointing.directory import committed_steps, step_dir_name
from meshformer.checkpointing.manifest import verify_manifest
from meshformer.errors import run_command

STEPS = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return reference_files(tmp_path_factory.mktemp("run_lock"), STEPS)


def _train_process(shards: Path, run_dir: Path, steps: int) -> subprocess.Popen:
    argv = ["train", str(CONFIGS / "tiny-gpt.toml"), "--set", *tiny_overrides(shards, run_dir, steps)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "meshformer.cli", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_run_on_a_busy_run_dir_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    shards, run_dir = tiny_shards(tmp_path), tmp_path / "run"
    root = run_dir / "checkpoints"
    first = _train_process(shards, run_dir, 100_000)
    try:
        deadline = time.monotonic() + 240
        while not committed_steps(root) and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert committed_steps(root), first.communicate(timeout=60) if first.poll() is not None else "no checkpoint"
        second = _train_process(shards, run_dir, 2)
        _, err = second.communicate(timeout=240)
        assert second.returncode == 1 and err.count("\n") == 1 and err.startswith("error: "), err
        assert f"{run_dir} is in use by pid {first.pid} on host " in err and "set logging.run_dir" in err, err
        assert first.poll() is None  # the first run was not disturbed
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: the OS drops its lock, nothing stale is left
        first.communicate(timeout=60)
    steps = committed_steps(root)
    for step in steps:
        verify_manifest(root / step_dir_name(step), "sha256")
        assert read_full_tensors(root / step_dir_name(step))
    third = _train_process(shards, run_dir, steps[-1] + 2)  # the killed run's folder resumes at once
    out, err = third.communicate(timeout=240)
    assert third.returncode == 0, err[-3000:]
    assert f"resumed from {root / step_dir_name(steps[-1])}" in out + err
    assert (run_dir / "final" / "model.safetensors").is_file()


def test_a_commit_never_replaces_a_committed_checkpoint(tmp_path):
    committed = tmp_path / step_dir_name(6)
    committed.mkdir()
    (committed / "weights.bin").write_bytes(b"the winner's checkpoint")
    partial = partial_dir(tmp_path, 6)
    partial.mkdir()
    (partial / "weights.bin").write_bytes(b"the loser's checkpoint")
    with pytest.raises(CheckpointError) as info:
        commit(partial, 6)
    line = info.value.one_line()
    assert "already holds a committed checkpoint of step 6" in line and "only one run" in line and "\n" not in line
    assert (committed / "weights.bin").read_bytes() == b"the winner's checkpoint"
    assert (partial / "weights.bin").read_bytes() == b"the loser's checkpoint"


def test_a_size_only_resume_says_its_content_was_not_checked(reference, tmp_path):
    from meshformer.train.trainer import Trainer

    run_dir = tmp_path / "run"
    run_trainer(tiny_config(reference["shards"], run_dir, 2))
    trainer = Trainer(tiny_config(reference["shards"], run_dir, STEPS, 'checkpoint.verify="size"'))
    messages: list[str] = []
    trainer.checkpoints.log = messages.append
    assert trainer.checkpoints.resume(trainer.checkpointable)
    warned = [m for m in messages if m.startswith("WARNING") and "checked by file sizes only" in m]
    assert len(warned) == 1 and "step 2" in warned[0] and "content was not checked" in warned[0], messages
    assert "checkpoint.verify=\"sha256\"" in warned[0] and "meshformer convert verify" in warned[0]


def test_a_full_disk_under_async_saves_is_one_line_and_the_run_resumes(reference, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from meshformer.checkpointing import sharded_safetensors
    from meshformer.train.trainer import train

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    run_dir = tmp_path / "run"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.async_save=true")
    with monkeypatch.context() as patch:
        patch.setattr(dcp_fs, "_write_item", full)
        patch.setattr(sharded_safetensors.ShardedWriter, "add_part", full)  # the final weights' file writes
        with pytest.raises(SystemExit) as info:
            run_command(train, cfg)
    line = str(info.value.code)
    assert line.startswith("error: no space left on device while writing the final weights") and "\n" not in line
    assert "free space" in line and "run the same command again" in line
    assert not (run_dir / "final").exists() and not (run_dir / "final.partial").exists()
    train(cfg)  # space is back: the same command finishes the run
    assert_bitwise(final_weights(run_dir), reference["weights"])


def test_final_weights_replace_only_a_final_folder_of_ours(reference, tmp_path):
    from meshformer.folders import OutputFolderError
    from meshformer.train.preflight import check_final_folder

    legacy = tmp_path / "legacy"  # what an older meshformer wrote: no marker
    legacy.mkdir()
    for name in ("model_config.json", "model.safetensors"):
        (legacy / name).write_text("{}")
    check_final_folder(legacy)
    check_final_folder(reference["run_dir"] / "final")  # this meshformer's (marked)
    check_final_folder(tmp_path / "missing")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "model.safetensors").write_text("someone else's")
    with pytest.raises(OutputFolderError, match="meshformer did not write"):
        check_final_folder(foreign)
    assert (reference["run_dir"] / "final" / ".meshformer").is_file()  # the run marked its final/ as ours
