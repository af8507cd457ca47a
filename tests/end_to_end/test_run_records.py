"""A run folder is a record (#24): a re-run with another config continues (more steps, said in one line, the
earlier config kept in configs/) or is refused naming --new-run; nothing is rewritten by a run that trains nothing;
Ctrl-C saves and stops like SIGTERM, in a line instead of a traceback, with the shell's status for Ctrl-C."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.common import CONFIGS, ROOT
from helpers.data import shards

from meshformer.checkpointing.directory import committed_steps
from meshformer.cli import main
from meshformer.config import load_config

CFG = str(CONFIGS / "tiny-gpt.toml")
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false", "data.num_workers=0",
        "logging.log_interval=1"]


def _train(run: Path, data: Path, *overrides: str) -> list[str]:
    return ["train", CFG, "--set", *TINY, f"logging.run_dir={run}", f"data.shards={data}", *overrides]


def _snapshot(run: Path) -> dict[str, tuple[str, int]]:
    """Every file of the run folder (lock files aside): content hash and modification time."""
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and p.suffix != ".lock"}


@pytest.fixture
def finished(tmp_path, one_thread) -> tuple[Path, Path]:
    """A finished 2-step run with checkpoints, and its shards."""
    data = shards(tmp_path)
    run = tmp_path / "run"
    main(_train(run, data, "train.steps=2", "checkpoint.interval=1"))
    return run, data


def test_changed_config_that_trains_nothing_is_refused_and_rewrites_nothing(finished, capsys):
    run, data = finished
    before = _snapshot(run)
    with pytest.raises(SystemExit) as info:
        main(_train(run, data, "train.steps=2", "checkpoint.interval=1", "optim.lr=0.01"))
    line = str(info.value.code)
    assert line.startswith("error: ") and "already reached step 2" in line and "optim.lr" in line, line
    assert "--new-run" in line and "\n" not in line
    assert _snapshot(run) == before


def test_every_run_writes_metrics_jsonl_one_object_per_logged_step(finished):
    run, _ = finished
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # logging.log_interval=1; the checkpoint of step 1 commits after that step's object is on disk, and its save
    # time (known only then) follows in an object of its own
    assert [row["step"] for row in rows] == [1, 1, 2]
    assert rows[1].keys() == {"step", "checkpoint/save_s"}
    assert {"train/loss", "perf/tokens_per_s", "perf/tokens_per_s_per_rank", "perf/memory_gib",
            "perf/memory_now_gib"} <= rows[0].keys()


def test_same_config_again_rewrites_nothing(finished):
    run, data = finished
    before = _snapshot(run)
    main(_train(run, data, "train.steps=2", "checkpoint.interval=1"))
    assert _snapshot(run) == before  # neither config.toml nor the final weights written again


def test_more_steps_with_a_changed_config_continues_and_keeps_the_history(finished, capfd):
    run, data = finished
    first = (run / "config.toml").read_text()
    capfd.readouterr()
    main(_train(run, data, "train.steps=4", "checkpoint.interval=1", "optim.lr=0.01"))
    said = [line for line in capfd.readouterr().err.splitlines() if "continuing the run" in line]
    assert len(said) == 1 and "from step 2 to 4" in said[0] and "optim.lr: 0.003 -> 0.01" in said[0], said
    assert (run / "configs" / "config-step00000002.toml").read_text() == first
    now = load_config(run / "config.toml")
    assert now.optim.lr == 0.01 and now.train.steps == 4
    assert committed_steps(run / "checkpoints")[-1] == 4


def test_new_run_goes_into_a_fresh_folder_beside_the_old_one(finished, capsys):
    run, data = finished
    before = _snapshot(run)
    main([*_train(run, data, "train.steps=2", "optim.lr=0.01"), "--new-run"])
    fresh = run.with_name("run-2")
    assert f"this run goes into {fresh}" in capsys.readouterr().err
    assert load_config(fresh / "config.toml").optim.lr == 0.01 and (fresh / "final").is_dir()
    assert _snapshot(run) == before


def test_finished_run_without_checkpoints_is_not_retrained_with_another_config(tmp_path, one_thread):
    data = shards(tmp_path)
    run = tmp_path / "run"
    main(_train(run, data, "train.steps=1", "checkpoint.interval=0"))
    before = _snapshot(run)
    with pytest.raises(SystemExit) as info:
        main(_train(run, data, "train.steps=3", "checkpoint.interval=0"))
    line = str(info.value.code)
    assert "holds the final weights of a finished run" in line and "--new-run" in line, line
    assert _snapshot(run) == before


def test_another_runs_checkpoint_dir_is_refused_unless_the_config_says_resume_it(tmp_path, one_thread):
    """Two runs (two run folders) naming one checkpoint.dir: the second would adopt the first's checkpoint and write
    its weights as its own final. Refused before any work; checkpoint.resume_other_run=true continues from it; the
    first run still resumes its own."""
    data, shared = shards(tmp_path), tmp_path / "shared-ckpt"
    first, second = tmp_path / "first", tmp_path / "second"
    main(_train(first, data, "train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={shared}"))
    before = _snapshot(shared)
    with pytest.raises(SystemExit) as info:
        main(_train(second, data, "train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={shared}",
                    "optim.lr=0.01"))
    line = str(info.value.code)
    assert line.startswith("error: ") and "\n" not in line, line
    assert f"holds step-00000002 of the run in {first}" in line and "checkpoint.resume_other_run=true" in line, line
    assert _snapshot(shared) == before and not (second / "final").exists()
    main(_train(second, data, "train.steps=3", "checkpoint.interval=1", f"checkpoint.dir={shared}",
                "checkpoint.resume_other_run=true"))
    assert committed_steps(shared)[-1] == 3 and (second / "final").is_dir()


def test_a_run_resumes_its_own_checkpoint_dir(tmp_path, one_thread, capfd):
    data, own, run = shards(tmp_path), tmp_path / "own-ckpt", tmp_path / "run"
    main(_train(run, data, "train.steps=2", "checkpoint.interval=1", f"checkpoint.dir={own}"))
    capfd.readouterr()
    main(_train(run, data, "train.steps=3", "checkpoint.interval=1", f"checkpoint.dir={own}"))
    assert f"resumed from {own / 'step-00000002'}" in capfd.readouterr().err
    assert committed_steps(own)[-1] == 3


def test_ctrl_c_saves_a_checkpoint_and_stops_without_a_traceback(tmp_path):
    data = shards(tmp_path)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "meshformer.cli", *_train(run, data, "train.steps=100000",
                                                                             "checkpoint.interval=100000")],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "config.toml").exists() and time.monotonic() < deadline:  # written as training starts
            time.sleep(0.2)
        time.sleep(1.0)  # a few steps in
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "SIGINT received: finishing this step, saving a checkpoint, then stopping" in err, err[-3000:]
    steps = committed_steps(run / "checkpoints")
    # stopped, not finished: `train && export` must not go on; 130 is the shell's status for Ctrl-C
    assert proc.returncode == 130 and len(steps) == 1 and 0 < steps[0] < 100000, (proc.returncode, steps)
    assert f"stopped by SIGINT after step {steps[0]}/100000: checkpoint" in err, err[-3000:]
    assert "run the same command to resume (exit status 130)" in err, err[-3000:]


def test_a_kill_right_after_a_checkpoint_keeps_that_steps_metrics(tmp_path):
    """SIGKILL moments after the checkpoint of step 2 commits: metrics.jsonl already holds step 2, which the resumed
    run (starting after step 2) never logs again."""
    from helpers.cluster import INJECT

    data = shards(tmp_path)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(INJECT), str(ROOT))), "OMP_NUM_THREADS": "1",
           "MF_TEST_STEP_SLEEP_S": "1.5"}
    proc = subprocess.Popen([sys.executable, "-m", "meshformer.cli", *_train(run, data, "train.steps=100",
                                                                             "checkpoint.interval=2")],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not committed_steps(run / "checkpoints") and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert committed_steps(run / "checkpoints") == [2]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2]
