"""Exact resume in one process: 2N steps == N steps + crash + restart + N steps, bitwise; fallbacks; SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal

import pytest
import torch
from helpers.checkpoints import (
    assert_bitwise,
    copy_steps,
    final_weights,
    reference_run,
    run_trainer,
    tiny_config,
)

from meshformer.checkpointing import CheckpointError, CheckpointManager
from meshformer.checkpointing.directory import committed_steps, partial_dirs, read_latest, step_dir_name

STEPS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted run of STEPS steps with blocking saves every 2 steps."""
    root = tmp_path_factory.mktemp("resume")
    shards, run_dir, trainer, result = reference_run(root, STEPS)
    return {"root": root, "shards": shards, "run_dir": run_dir, "history": result.history,
            "weights": final_weights(run_dir), "optimizer": _optimizer_state(trainer),
            "data": trainer.train_data.state_dict(), "tokens": int(trainer.tokens_seen),
            "lr": trainer.scheduler.get_last_lr()}


def _optimizer_state(trainer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {f"{names[id(p)]}.{k}": v.clone() for p, s in trainer.optimizer.state.items() for k, v in s.items()}


def _losses(history: list[dict], after: int) -> list[tuple[int, float]]:
    return [(h["step"], h["train/loss"]) for h in history if h["step"] > after]


def _logged_losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]


def test_crash_and_restart_is_bitwise(reference, tmp_path):
    """Async saves while training, a crash before step 4, a restart from step 2: the same run, bit for bit."""
    run_dir = tmp_path / "interrupted"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.async_save=true")
    trainer, result = run_trainer(cfg, crash_after=3)
    assert result is None and trainer.step == 3
    assert committed_steps(run_dir / "checkpoints") == [2]

    trainer, result = run_trainer(cfg)
    assert result.steps == STEPS
    assert_bitwise(final_weights(run_dir), reference["weights"])
    assert_bitwise(_optimizer_state(trainer), reference["optimizer"])
    assert _losses(result.history, 2) == _losses(reference["history"], 2)
    assert trainer.train_data.state_dict() == reference["data"]
    assert int(trainer.tokens_seen) == reference["tokens"]
    assert trainer.scheduler.get_last_lr() == reference["lr"]
    # the log too: step 3, logged before the crash, is dropped and logged again by the restart (one line per step)
    assert _logged_losses(run_dir) == _logged_losses(reference["run_dir"])


def _loader_draws_from_global_rng(cfg) -> bool:
    """Whether starting a data iterator consumes the global torch RNG (DataLoader without generator=)."""
    from meshformer.data import build_loader, load_tokenizer

    loader = build_loader(cfg, load_tokenizer(cfg.data.tokenizer), "train", 0, 1)
    before = torch.get_rng_state()
    next(loader)
    return not torch.equal(before, torch.get_rng_state())


def test_crash_and_restart_with_dropout_is_bitwise(reference, tmp_path):
    """Dropout makes the RNG part of the state: restored per rank, the restarted run is still the same run."""
    run_dir = tmp_path / "dropout"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "model.dropout=0.1", "model.attention.dropout=0.1")
    assert not _loader_draws_from_global_rng(cfg), "a new data iterator must not consume the global torch RNG"
    _, uninterrupted = run_trainer(tiny_config(reference["shards"], tmp_path / "full", STEPS, "model.dropout=0.1",
                                               "model.attention.dropout=0.1"))
    run_trainer(cfg, crash_after=3)
    _, result = run_trainer(cfg)
    assert_bitwise(final_weights(run_dir), final_weights(tmp_path / "full"))
    assert _losses(result.history, 2) == _losses(uninterrupted.history, 2)


def test_corrupt_truncated_and_partial_checkpoints_fall_back(reference, tmp_path):
    """Newest checkpoint bit-flipped, the one before truncated, a newer .partial: resume uses the oldest valid."""
    source = reference["run_dir"] / "checkpoints"
    assert committed_steps(source) == [2, 4, 6]
    root = copy_steps(source, tmp_path / "run" / "checkpoints", 2, 4, 6)
    shard = root / step_dir_name(6) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    truncated = root / step_dir_name(4) / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:-100])
    shutil.copytree(root / step_dir_name(2), root / (step_dir_name(8) + ".partial"))
    (root / (step_dir_name(8) + ".partial") / "manifest.json").unlink()

    cfg = tiny_config(reference["shards"], tmp_path / "run", STEPS, "checkpoint.interval=100")
    messages: list[str] = []
    manager = CheckpointManager.from_config(cfg, tmp_path / "run", log=messages.append)
    found = manager.find_valid()
    manager.close()
    assert found == root / step_dir_name(2)
    assert any("step-00000006" in m and "sha256" in m for m in messages), messages
    assert any("step-00000004" in m and "truncated" in m for m in messages), messages
    assert committed_steps(root) == [2]  # the corrupt ones were moved aside, not deleted
    assert len(list(root.glob("step-*.corrupt-*"))) == 2

    run_trainer(cfg)  # resumes from step 2 and finishes: still the reference run
    assert_bitwise(final_weights(tmp_path / "run"), reference["weights"])
    assert partial_dirs(root) == []  # the final save cleared the stale partial folder
    assert read_latest(root) == step_dir_name(STEPS)


def test_sigterm_saves_and_stops(reference, tmp_path):
    run_dir = tmp_path / "preempted"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.interval=100")
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    _, result = run_trainer(cfg, sigterm_after=3)
    assert result.steps == 3 and result.stopped_by == signal.SIGTERM
    # in a process that goes on (a library user's, this one), the stop leaves the signals as they were: an ignored
    # SIGTERM would be inherited by every process it starts later
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert committed_steps(run_dir / "checkpoints") == [3]
    assert not (run_dir / "final").exists()  # an unfinished run writes no final weights
    state = json.loads((run_dir / "checkpoints" / step_dir_name(3) / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["data"]["consumed"] == 3 * 4


def test_retention_keeps_last_and_every_mth(tmp_path):
    """Async saves at every step, keep the last 2 and every 2nd: the rest is deleted once a newer one commits."""
    from meshformer.checkpointing import Checkpointable, TrainState
    from meshformer.config import load_config
    from meshformer.model import Transformer

    cfg = load_config(None, ["model.d_model=16", "model.attention.n_heads=2", "model.n_layers=1", "model.ffn.d_ff=32",
                             "model.vocab_size=64", "checkpoint.interval=1", "checkpoint.keep_last=2",
                             "checkpoint.keep_every=2", "checkpoint.async_save=true", "train.steps=5"])
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters())
    run = Checkpointable(TrainState(), [model], optimizer, {}, cfg)
    manager = CheckpointManager.from_config(cfg, tmp_path)
    for _ in range(cfg.train.steps):
        model(torch.randint(0, 64, (2, 8))).sum().backward()
        optimizer.step()
        run.state.step += 1
        manager.after_step(run)
    manager.finish(run)
    root = tmp_path / "checkpoints"
    assert committed_steps(root) == [2, 4, 5]
    assert read_latest(root) == step_dir_name(5)
    manifest = json.loads((root / step_dir_name(5) / "manifest.json").read_text())
    assert {".metadata", "__0_0.distcp", "trainer_state.json", "rank-00000.json"} <= set(manifest["files"])


def test_resume_into_a_different_model_names_the_problem(reference, tmp_path):
    root = copy_steps(reference["run_dir"] / "checkpoints", tmp_path / "other" / "checkpoints", 6)
    cfg = tiny_config(reference["shards"], tmp_path / "other", STEPS, "model.ffn.d_ff=128")
    with pytest.raises(CheckpointError, match=r"shape .* different model"):
        run_trainer(cfg)
    assert root.exists()


def test_checkpoint_holds_no_pickles(reference):
    """Non-tensor state is JSON; the DCP index is read by an allowlisting unpickler (see test_checkpoint_files)."""
    folder = reference["run_dir"] / "checkpoints" / step_dir_name(6)
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["data"]["consumed"] > 0 and state["tokens_seen"] == reference["tokens"]
    assert {p.suffix for p in folder.iterdir()} <= {".distcp", ".json", ".toml", ""}


def test_missing_rng_state_is_reported_and_seeded(reference, tmp_path):
    """A rank the checkpoint has no RNG file for (a grown world) gets fresh, logged, deterministic streams."""
    root = copy_steps(reference["run_dir"] / "checkpoints", tmp_path / "grown" / "checkpoints", 6)
    (root / step_dir_name(6) / "rank-00000.json").unlink()
    (root / step_dir_name(6) / "manifest.json").unlink()  # re-commit without the file
    from meshformer.checkpointing.manifest import write_manifest

    write_manifest(root / step_dir_name(6), 6)
    cfg = tiny_config(reference["shards"], tmp_path / "grown", STEPS)
    messages: list[str] = []
    from meshformer.train.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.checkpoints.log = messages.append
    assert trainer.checkpoints.resume(trainer.checkpointable)
    trainer.checkpoints.close()
    assert trainer.step == 6
    assert any("no RNG state" in m for m in messages), messages


def test_training_starts_from_converted_weights(reference, tmp_path):
    """A weights folder converted to a checkpoint (e.g. imported from Hugging Face) starts a run at step 0."""
    from meshformer.cli import main
    from meshformer.train.trainer import Trainer

    converted = tmp_path / "converted"
    main(["convert", "to-checkpoint", str(reference["run_dir"] / "final"), str(converted)])
    trainer = Trainer(tiny_config(reference["shards"], tmp_path / "finetune", STEPS, f'checkpoint.dir="{converted}"'))
    assert trainer.checkpoints.resume(trainer.checkpointable)
    trainer.checkpoints.close()
    assert trainer.step == 0 and not trainer.optimizer.state
    weights = {k: v for k, v in trainer.model.state_dict().items() if k != "output.weight"}  # tied
    assert_bitwise(weights, reference["weights"])


def test_a_stop_saves_a_checkpoint_without_periodic_ones(reference, tmp_path):
    """checkpoint.interval=0 (only the final weights): a stop signal still commits its step, so a restart resumes."""
    run_dir = tmp_path / "preempted"
    cfg = tiny_config(reference["shards"], run_dir, STEPS, "checkpoint.interval=0")
    _, result = run_trainer(cfg, sigterm_after=2)
    assert result.stopped_by == signal.SIGTERM and committed_steps(run_dir / "checkpoints") == [2]
    _, result = run_trainer(cfg)
    assert result.steps == STEPS and result.stopped_by is None
    assert_bitwise(final_weights(run_dir), reference["weights"])
