"""Nothing lost or changed in silence: other-shape resumes, all-corrupt directories, failed and disk-full saves,
SIGKILL during retention, a changed train.steps. Each case stops with one clear line or is reported loudly."""

from __future__ import annotations

import errno
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import assert_bitwise, copy_steps, final_weights, reference_files, run_trainer, tiny_config

from meshformer.checkpointing import CheckpointError
from meshformer.checkpointing.dcp_io import read_full_tensors
from meshformer.checkpointing.directory import committed_steps, deleting_dirs, partial_dirs, step_dir_name
from meshformer.checkpointing.manifest import verify_manifest

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of STEPS steps (2 layers) with blocking saves every 2 steps."""
    return reference_files(tmp_path_factory.mktemp("silent"), STEPS)


def _trainer(cfg, messages: list[str] | None = None):
    from meshformer.train.trainer import Trainer

    trainer = Trainer(cfg)
    if messages is not None:
        trainer.checkpoints.log = lambda m: messages.append(f"[step {trainer.step}] {m}")
    return trainer


def _all_verify(root: Path) -> None:
    for step in committed_steps(root):
        verify_manifest(root / step_dir_name(step))


# ----------------------------------------------------------------------------- other model shapes


def test_resume_into_fewer_layers_is_refused_naming_the_keys(reference, tmp_path):
    root = copy_steps(reference["run_dir"] / "checkpoints", tmp_path / "run" / "checkpoints", 4, 6)
    cfg = tiny_config(reference["shards"], tmp_path / "run", 8, "model.n_layers=1", "checkpoint.keep_last=1")
    with pytest.raises(CheckpointError) as info:
        run_trainer(cfg)
    message = str(info.value)
    assert "\n" not in message and " — " in message
    assert "unexpected" in message and "decoder_layers.1." in message
    assert 'checkpoint.load_mode="partial"' in message
    assert committed_steps(root) == [4, 6]  # nothing trained, nothing deleted
    _all_verify(root)
    assert not (tmp_path / "run" / "final").exists()


def test_resume_into_another_width_names_mismatched_and_missing(reference, tmp_path):
    copy_steps(reference["run_dir"] / "checkpoints", tmp_path / "run" / "checkpoints", 6)
    cfg = tiny_config(reference["shards"], tmp_path / "run", 8, "model.n_layers=3", "model.ffn.d_ff=48")
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: decoder_layers\.2\..*another shape"):
        run_trainer(cfg)


def test_partial_load_takes_what_fits_and_retention_keeps_the_other_model(reference, tmp_path):
    source = reference["run_dir"] / "checkpoints"
    root = copy_steps(source, tmp_path / "run" / "checkpoints", 6)
    cfg = tiny_config(reference["shards"], tmp_path / "run", 10, "model.n_layers=1", "checkpoint.keep_last=1",
                      'checkpoint.load_mode="partial"')
    messages: list[str] = []
    trainer = _trainer(cfg, messages)
    assert trainer.checkpoints.resume(trainer.checkpointable)
    assert trainer.step == 6
    saved = read_full_tensors(root / step_dir_name(6))
    here = trainer.model.state_dict()
    assert torch.equal(here["decoder_layers.0.attn.q_proj.weight"], saved["model.decoder_layers.0.attn.q_proj.weight"])
    assert torch.equal(here["decoder_norm.weight"], saved["model.decoder_norm.weight"])
    assert any("partial" in m and "decoder_layers.1." in m for m in messages), messages
    trainer.fit()  # steps 7-10, saves at 8 and 10 with keep_last=1
    assert committed_steps(root) == [6, 10]  # the 2-layer checkpoint is another model's: retention keeps it
    assert any("retention keeps step-00000006" in m for m in messages), messages
    _all_verify(root)


# ----------------------------------------------------------------------------- corrupt directories


def test_every_checkpoint_corrupt_stops_instead_of_starting_at_zero(reference, tmp_path):
    root = copy_steps(reference["run_dir"] / "checkpoints", tmp_path / "run" / "checkpoints", 4, 6)
    for step in (4, 6):
        shard = root / step_dir_name(step) / "__0_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 3] ^= 0x10
        shard.write_bytes(bytes(data))
    cfg = tiny_config(reference["shards"], tmp_path / "run", STEPS)
    with pytest.raises(CheckpointError) as info:
        run_trainer(cfg)
    message = str(info.value)
    assert "every checkpoint" in message and "step-00000006" in message and "step-00000004" in message
    assert "sha256" in message and "to start from step 0" in message and "\n" not in message
    assert committed_steps(root) == [4, 6] and not list(root.glob("*.corrupt-*"))  # left where they were


# ----------------------------------------------------------------------------- failed saves


def _failing_writes(monkeypatch, *, fail_calls: set[int], err: OSError) -> list[int]:
    """Make DCP's file writer raise `err` on the given calls (0-based, one call per file written)."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    real, calls = dcp_fs._write_item, []

    def write_item(*args, **kwargs):
        calls.append(len(calls))
        if calls[-1] in fail_calls:
            raise err
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    return calls


def test_failed_async_save_is_reported_next_step_and_final_weights_written(reference, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.async_save=true")
    _failing_writes(monkeypatch, fail_calls={0}, err=OSError(errno.ENOSPC, "No space left on device"))
    messages: list[str] = []
    trainer = _trainer(cfg, messages)
    result = trainer.fit()
    assert result.steps == STEPS and trainer.checkpoints.failed_saves == 1
    # Reported at the first step boundary after the write failed, at the latest before the next save starts.
    warned = [i for i, m in enumerate(messages) if "WARNING" in m and "step 2" in m]
    assert len(warned) == 1, messages
    assert messages[warned[0]].startswith(("[step 3]", "[step 4]")), messages
    assert "no space left on device" in messages[warned[0]] and "training continues" in messages[warned[0]]
    assert warned[0] < min(i for i, m in enumerate(messages) if "checkpoint step 4 saved" in m)
    assert committed_steps(run_dir / "checkpoints") == [4, 6] and partial_dirs(run_dir / "checkpoints") == []
    assert_bitwise(final_weights(run_dir), reference["weights"])  # the failed save changed nothing else


def test_failed_interval_save_in_a_replica_group_is_skipped_with_a_line(reference, tmp_path, monkeypatch):
    """In a replica group (fault tolerance) a failed blocking save at the interval does not stop the group: one
    line, the committed checkpoints untouched, the next save tries again."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(reference["shards"], run_dir, STEPS)
    _failing_writes(monkeypatch, fail_calls={0}, err=OSError(errno.EIO, "Input/output error"))
    messages: list[str] = []
    trainer = _trainer(cfg, messages)
    trainer.checkpoints.skip_failed_saves = "replica group 1"  # what the trainer sets with fault_tolerance.enabled
    result = trainer.fit()
    assert result.steps == STEPS and trainer.checkpoints.failed_saves == 1
    warned = [m for m in messages if "WARNING" in m]
    assert len(warned) == 1 and warned[0].startswith("[step 2] WARNING: saving checkpoint step 2"), messages
    assert "replica group 1: this save is skipped; training continues" in warned[0], warned
    assert committed_steps(run_dir / "checkpoints") == [4, 6]
    _all_verify(run_dir / "checkpoints")
    assert_bitwise(final_weights(run_dir), reference["weights"])


def test_disk_full_names_it_keeps_the_previous_step_and_removes_partial(reference, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    root = copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    cfg = tiny_config(reference["shards"], run_dir, STEPS)
    _failing_writes(monkeypatch, fail_calls=set(range(1000)), err=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError) as info:
        run_trainer(cfg)  # resumes at 4; the final save (step 6) hits a full disk
    message = str(info.value)
    assert message.startswith("no space left on device while saving checkpoint step 6")
    assert "step-00000004 (the newest checkpoint) is intact" in message and "removed" in message
    assert " — " in message and "\n" not in message
    assert committed_steps(root) == [4] and partial_dirs(root) == [] and deleting_dirs(root) == []
    _all_verify(root)
    assert_bitwise(final_weights(run_dir), reference["weights"])  # the trained weights were still written


# ----------------------------------------------------------------------------- SIGKILL during retention

_KILLED_DURING_RETENTION = """
import shutil, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from helpers.checkpoints import run_trainer, tiny_config

real_rmtree = shutil.rmtree

def rmtree_then_hang(path, *args, **kwargs):
    # retention of a committed step: delete one file, then wait to be killed half-way through the delete
    path = Path(path)
    if path.name.startswith("step-") and ".partial" not in path.name:
        files = sorted(p for p in path.rglob("*") if p.is_file())
        files[0].unlink()
        Path(sys.argv[4]).write_text(path.name)
        time.sleep(600)
    return real_rmtree(path, *args, **kwargs)

shutil.rmtree = rmtree_then_hang
run_trainer(tiny_config(Path(sys.argv[2]), Path(sys.argv[3]), 6, "checkpoint.keep_last=1"))
"""


def test_sigkill_during_retention_leaves_no_half_deleted_checkpoint(reference, tmp_path):
    from meshformer.cli import main

    run_dir, marker = tmp_path / "run", tmp_path / "deleting"
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_DURING_RETENTION)
    tests_dir = Path(__file__).resolve().parents[1]
    # The killed run trains steps 1-4 with this process's thread count: bitwise equality needs the same reductions.
    env = {"PYTHONPATH": str(tests_dir.parent), "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, str(script), str(tests_dir), str(reference["shards"]), str(run_dir),
                             str(marker)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.kill()  # SIGKILL in the middle of deleting step 2 (after step 4 was committed)
    out, _ = proc.communicate()
    assert marker.exists(), out[-3000:]
    root = run_dir / "checkpoints"
    assert committed_steps(root) == [4]  # step 2 is no longer under a committed name
    main(["convert", "verify", str(root)])  # exits non-zero on any CORRUPT folder

    run_trainer(tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.keep_last=1"))
    assert deleting_dirs(root) == [] and committed_steps(root) == [STEPS]
    assert_bitwise(final_weights(run_dir), reference["weights"])


# ----------------------------------------------------------------------------- changed train.steps


def test_resume_with_more_steps_uses_the_new_schedule_from_its_first_step(reference, tmp_path):
    from meshformer.train.optim import lr_multiplier

    run_dir = tmp_path / "run"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    cfg = tiny_config(reference["shards"], run_dir, 12)
    trainer = _trainer(cfg)
    assert trainer.checkpoints.resume(trainer.checkpointable) and trainer.step == 4
    fresh = cfg.optim.lr * lr_multiplier(4, cfg.schedule, 12, cfg.model.d_model)
    old = cfg.optim.lr * lr_multiplier(4, cfg.schedule, STEPS, cfg.model.d_model)
    assert fresh != old
    trainer.train_step()
    trainer.checkpoints.close()
    assert trainer.last_lr == pytest.approx(fresh, rel=1e-12)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        cfg.optim.lr * lr_multiplier(5, cfg.schedule, 12, cfg.model.d_model), rel=1e-12)


# ----------------------------------------------------------------------------- changed data.seed


def test_changed_data_seed_names_the_option_and_reseed_continues_at_the_position(reference, tmp_path):
    from meshformer.data import DataStateError, build_loader

    run_dir = tmp_path / "run"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    with pytest.raises(DataStateError) as info:
        run_trainer(tiny_config(reference["shards"], run_dir, STEPS, "data.seed=99"))
    message = str(info.value)
    assert "data.seed: 1234 -> 99" in message and "data.reseed_on_resume=true" in message and " — " in message

    cfg = tiny_config(reference["shards"], run_dir, STEPS, "data.seed=99", "data.reseed_on_resume=true")
    trainer = _trainer(cfg)
    assert trainer.checkpoints.resume(trainer.checkpointable) and trainer.step == 4
    trainer.checkpoints.close()
    assert trainer.train_data.consumed == 4 * 4  # the checkpoint's position, kept
    fresh = build_loader(cfg, trainer.tokenizer, "train", 0, 1)
    fresh.consumed = 16  # the stream of seed 99 from position 16
    got, want = next(trainer.train_data), next(fresh)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    old_order = build_loader(tiny_config(reference["shards"], run_dir, STEPS), trainer.tokenizer, "train", 0, 1)
    old_order.consumed = 16
    assert not torch.equal(next(old_order)["input_ids"], got["input_ids"])  # the seed did change the order


def test_resume_with_another_peak_lr_uses_it_from_the_first_step(reference, tmp_path):
    from meshformer.train.optim import lr_multiplier

    run_dir = tmp_path / "run"
    copy_steps(reference["run_dir"] / "checkpoints", run_dir / "checkpoints", 4)
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "optim.lr=0.001")
    trainer = _trainer(cfg)
    assert trainer.checkpoints.resume(trainer.checkpointable)
    trainer.checkpoints.close()
    want = 0.001 * lr_multiplier(4, cfg.schedule, STEPS, cfg.model.d_model)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([want, want], rel=1e-12)
