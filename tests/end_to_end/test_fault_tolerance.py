"""Fault-tolerant replica groups (torchft): a group killed mid-run while the other trains on, restarts and heals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cluster import children, finish, logs, overrides, start, wait_for, worker_env
from helpers.common import free_port

from meshformer.launcher.warm_rank import process_rank

STEPS = 48
GROUPS = 2


def _records(run_dir: Path, replica: int) -> list[dict]:
    path = run_dir / f"replica-{replica}" / "replicas.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _rank_pid(launcher: int, replica: int, rank: int) -> int | None:
    """The pid of `rank` of replica group `replica` (launcher -> torchrun agent -> ranks), from /proc."""
    def env(pid: int) -> dict[str, str]:
        try:
            items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return {}
        return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)

    for agent in children(launcher):
        if env(agent).get("MESHFORMER_REPLICA_ID") == str(replica):
            for worker in children(agent):
                if process_rank(worker) == rank:  # a rank started by torchrun, or a warm rank it handed over to
                    return worker
    return None


@pytest.mark.slow
def test_a_killed_group_restarts_and_heals_while_the_other_trains_on(tmp_path):
    """2 groups x 2 ranks (FSDP inside each, Muon): kill -9 one rank of group 1 mid-run. Group 0 commits its next
    step within seconds (not the 120 s collective timeout) with 1 replica; group 1 restarts, heals from group 0 (no
    checkpoint on disk to resume from: checkpoint.interval=0), rejoins; both end at train.steps with bitwise-equal
    weights, and the replicas.jsonl records agree on which groups trained each step and its data."""
    run_dir = tmp_path / "run"
    config = [*overrides(tmp_path, run_dir), f"train.steps={STEPS}", "logging.log_interval=1", "checkpoint.interval=0",
              "optim.name=muon", "parallel.dp_shard=2", "parallel.timeout_s=120", "fault_tolerance.timeout_s=120",
              "fault_tolerance.heartbeat_timeout_s=1", "fault_tolerance.join_timeout_s=2"]
    env = worker_env(MF_TEST_STEP_SLEEP_S="0.8")  # long enough a run for the killed group to come back
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
           "--nproc-per-node", "2", "--set", *config]
    log = tmp_path / "launcher.log"
    proc = start(cmd, env, log)
    try:
        wait_for(lambda: len(_records(run_dir, 1)) >= 4, 240, f"group 1 to train 4 steps\n{logs(log)[-4000:]}")
        victim = _rank_pid(proc.pid, replica=1, rank=1)
        assert victim is not None, logs(log)[-4000:]
        before = len(_records(run_dir, 0))
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: any(len(r["replicas"]) == 1 for r in _records(run_dir, 0)[before:]), 60,
                 f"group 0 to commit a step alone\n{logs(log)[-4000:]}")
        alone_after = time.monotonic() - killed
        # the restarted group's ranks are its warm ranks (imports done while it trained), handed over by torchrun
        back = len(_records(run_dir, 1))
        wait_for(lambda: len(_records(run_dir, 1)) > back, 120, f"group 1 to rejoin\n{logs(log)[-4000:]}")
        restarted = [_rank_pid(proc.pid, replica=1, rank=r) for r in range(2)]
        names = [Path(f"/proc/{pid}/comm").read_text().strip() if pid else None for pid in restarted]
    finally:
        codes = finish([proc], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert alone_after < 30, f"group 0 waited {alone_after:.1f}s after the kill\n{text[-4000:]}"
    assert names == ["rank0", "rank1"], f"group 1 restarted on fresh interpreters, not its warm ranks: {names}"

    # The survivor said who dropped and who came back, and the killed group healed from the live peer.
    assert "replica group(s) [1] dropped" in text and "replica group(s) [1] joined" in text, text[-6000:]
    # the restart after the kill ran on the group's standby agent (started once the group had committed a step); a
    # start that failed before any step (a rendezvous port taken meanwhile) restarts without one and counts first
    assert re.search(r"restarting it \(restart \d+, on its standby agent\)", text), text[-6000:]
    assert "replica group 1 healed from a live peer" in text, text[-6000:]

    # Both groups reached train.steps with the same weights, bit for bit.
    from safetensors.torch import load_file

    weights = [load_file(str(run_dir / f"replica-{r}" / "final" / "model.safetensors")) for r in range(GROUPS)]
    assert set(weights[0]) == set(weights[1])
    differ = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
    assert not differ, f"the groups' final weights differ in {differ[:4]}"

    # The record: every step trained by the groups each line names, at the data position of that step, once.
    records = [r for g in range(GROUPS) for r in _records(run_dir, g)]
    global_batch = GROUPS * 2 * 4  # groups x data-parallel ranks x data.batch_size
    by_step: dict[int, list[dict]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    assert sorted(by_step) == list(range(1, STEPS + 1)), sorted(by_step)
    for step, lines in by_step.items():
        trained = sorted(line["replica"] for line in lines)
        assert len(set(trained)) == len(trained), f"step {step} recorded twice by one group: {lines}"
        assert all(line["replicas"] == trained for line in lines), f"step {step}: the groups disagree: {lines}"
        assert all(line["position"] == (step - 1) * global_batch for line in lines), lines
    solo = [s for s, lines in by_step.items() if len(lines) == 1]
    assert solo and max(solo) < STEPS, f"group 1 never rejoined after it was killed: {solo}"
    metrics = [json.loads(line) for line in (run_dir / "replica-0" / "metrics.jsonl").read_text().splitlines()]
    assert {m.get("ft/replicas") for m in metrics if "train/loss" in m} >= {1.0, 2.0}


LAYOUTS = {  # a layout inside each group: (model, overrides)
    "pp": ("tiny-gpt", ["parallel.pp=2", "parallel.dp_shard=1", "optim.name=muon"]),
    "ep": ("tiny-moe", ["parallel.ep=2", "optim.name=adamw"]),
    "tp": ("tiny-gpt", ["parallel.tp=2", "parallel.dp_shard=1", "optim.name=adamw"]),
}


@pytest.mark.slow
@pytest.mark.matrix  # 4 ranks and a restart each; FSDP with a kill is the CI row above
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_heal_leaves_groups_bitwise_equal_under_each_layout(tmp_path, layout):
    """2 groups x 2 ranks, pipeline stages (pp=2, Muon), expert shards (ep=2 on tiny-moe, AdamW) or tensor-parallel
    shards (tp=2, AdamW) inside each: rank 1 of group 1 killed before step 4. With min_replicas=2 group 0 waits;
    group 1 restarts with nothing on disk and heals each rank's stage, experts or shards from its counterpart in
    group 0. Both groups end at train.steps with a checkpoint of it holding bitwise-equal weights and optimizer
    state."""
    from meshformer.checkpointing.dcp_io import read_full_tensors
    from meshformer.checkpointing.state import OPTIM

    model, layout_overrides = LAYOUTS[layout]
    run_dir, steps = tmp_path / "run", 8
    config = [*overrides(tmp_path, run_dir), f"train.steps={steps}", "logging.log_interval=1",
              f"checkpoint.interval={steps}", "fault_tolerance.min_replicas=2", "fault_tolerance.heartbeat_timeout_s=1",
              "fault_tolerance.join_timeout_s=2", *layout_overrides]
    env = worker_env(MF_TEST_KILL_RANK="1", MF_TEST_KILL_STEP="4", MF_TEST_KILL_REPLICA="1",
                     MF_TEST_KILL_MARK=str(tmp_path / "killed"))
    cmd = [sys.executable, "-m", "meshformer", "train", model, "--replica-groups", str(GROUPS), "--nproc-per-node",
           "2", "--set", *config]
    log = tmp_path / "launcher.log"
    codes = finish([start(cmd, env, log)], 420)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert (tmp_path / "killed-1").exists() and "restarting it (restart 1" in text, text[-6000:]
    assert "replica group 1 healed from a live peer" in text, text[-6000:]
    saved = [sorted(p for p in (run_dir / f"replica-{r}").rglob("step-*") if p.suffix != ".partial")
             for r in range(GROUPS)]
    assert [[p.name for p in s] for s in saved] == [[f"step-{steps:08d}"]] * GROUPS, f"{saved}\n{text[-4000:]}"
    tensors = [read_full_tensors(s[0]) for s in saved]
    assert tensors[0].keys() == tensors[1].keys() and any(k.startswith(OPTIM) for k in tensors[0])
    differ = [k for k in tensors[0] if not torch.equal(tensors[0][k], tensors[1][k])]
    assert not differ, f"the groups end with different state in {differ[:4]}"
    records = [_records(run_dir, r) for r in range(GROUPS)]
    assert [line["step"] for line in records[0]] == list(range(1, steps + 1)), records[0]
    assert records[1] and records[1][-1]["step"] == steps and records[1][-1]["replicas"] == [0, 1], records[1]


@pytest.mark.slow
@pytest.mark.matrix  # DiLoCo's outer step is checked in tests/unit/runtime/test_semi_sync.py
def test_diloco_groups_synchronise_every_h_steps_and_end_equal(tmp_path):
    """2 groups x 1 rank, method=diloco, sync_every=3, 7 steps (a last window of one step), min_replicas=2: the
    groups train on their own batches between synchronisations and end at train.steps with bitwise-equal weights
    (the last synchronisation at train.steps); every step is recorded once per group, in a window of both."""
    run_dir, steps = tmp_path / "run", 7
    config = [*overrides(tmp_path, run_dir), f"train.steps={steps}", "logging.log_interval=1", "checkpoint.interval=0",
              "fault_tolerance.method=diloco", "fault_tolerance.sync_every=3", "fault_tolerance.min_replicas=2"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
           "--nproc-per-node", "1", "--set", *config]
    log = tmp_path / "launcher.log"
    codes = finish([start(cmd, worker_env(), log)], 240)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert "not committed" not in text, text[-6000:]
    from safetensors.torch import load_file

    weights = [load_file(str(run_dir / f"replica-{r}" / "final" / "model.safetensors")) for r in range(GROUPS)]
    differ = [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])]
    assert not differ, f"the groups' final weights differ in {differ[:4]}"
    # min_replicas=2: the first quorum waits for both groups; every step is recorded by both, in a window of both
    for r in range(GROUPS):
        records = _records(run_dir, r)
        assert [line["step"] for line in records] == list(range(1, steps + 1)), records
        assert all(line["replicas"] == [0, 1] for line in records), records
    # between synchronisations each group trains on its own batches: their losses differ
    losses = [[json.loads(line).get("train/loss") for line in (run_dir / f"replica-{r}" / "metrics.jsonl")
               .read_text().splitlines()] for r in range(GROUPS)]
    assert [x for x in losses[0] if x is not None] != [x for x in losses[1] if x is not None]


@pytest.mark.slow
@pytest.mark.matrix  # two runs; the outer state's round trip is checked in tests/unit/train/test_outer_state.py
def test_diloco_resumed_inside_a_window_ends_as_the_uninterrupted_run(tmp_path):
    """2 groups x 1 rank, DiLoCo with H=3 and a checkpoint at step 4 (inside the window 3..6): both groups killed
    before step 6 restart from it with the anchor and outer momentum it holds, train steps 5 and 6 on their own and
    synchronise after step 6, as the uninterrupted run did: both end with its weights, bit for bit, and with its
    record (steps 5 and 6 trained in the window of both groups, at the same data positions)."""
    steps = 8
    def run(name: str, **faults: str) -> str:
        run_dir = tmp_path / name
        config = [*overrides(tmp_path, run_dir), f"train.steps={steps}", "logging.log_interval=1",
                  "checkpoint.interval=4", "fault_tolerance.method=diloco", "fault_tolerance.sync_every=3",
                  "fault_tolerance.min_replicas=2", "fault_tolerance.heartbeat_timeout_s=1",
                  "fault_tolerance.join_timeout_s=2"]
        cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
               "--nproc-per-node", "1", "--set", *config]
        log = tmp_path / f"{name}.log"
        codes = finish([start(cmd, worker_env(**faults), log)], 300)
        text = logs(log)
        assert codes == [0], text[-6000:]
        return text

    run("reference")
    text = run("resumed", MF_TEST_KILL_RANK="0", MF_TEST_KILL_STEP="6", MF_TEST_KILL_MARK=str(tmp_path / "killed"))
    assert all((tmp_path / f"killed-{r}").exists() for r in range(GROUPS)), text[-6000:]
    for r in range(GROUPS):
        assert f"replica group {r} resumed inside a window at step 4" in text, text[-6000:]
    from safetensors.torch import load_file

    for r in range(GROUPS):
        want = load_file(str(tmp_path / "reference" / f"replica-{r}" / "final" / "model.safetensors"))
        got = load_file(str(tmp_path / "resumed" / f"replica-{r}" / "final" / "model.safetensors"))
        differ = [k for k in want if not torch.equal(want[k], got[k])]
        assert not differ, f"group {r} ends with other weights than the uninterrupted run in {differ[:4]}"
    for r in range(GROUPS):
        want_record, got_record = (
            [{k: v for k, v in line.items() if k != "time"} for line in _records(tmp_path / name, r)]
            for name in ("reference", "resumed"))
        assert [line["step"] for line in want_record] == list(range(1, steps + 1)), want_record
        assert got_record == want_record, f"group {r}'s record differs from the uninterrupted run's\n{text[-3000:]}"


@pytest.mark.slow
@pytest.mark.matrix  # the wait's decision is checked in tests/unit/runtime/test_quorum_wait.py
def test_a_group_below_min_replicas_waits_stops_with_a_checkpoint_and_the_run_goes_on(tmp_path):
    """2 groups x 1 rank, min_replicas=2: group 1 killed, group 0 waits fault_tolerance.wait_s with a line, then
    stops with a checkpoint of the step it reached and one error line. The same command again: group 0 resumes from
    that checkpoint, group 1 (no checkpoint of its own) heals from it, and both end at train.steps, equal."""
    run_dir, steps = tmp_path / "run", 8
    config = [*overrides(tmp_path, run_dir), f"train.steps={steps}", "logging.log_interval=1", "checkpoint.interval=0",
              "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=1",
              "fault_tolerance.heartbeat_timeout_s=1", "fault_tolerance.join_timeout_s=2"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
           "--nproc-per-node", "1", "--set", *config]
    log = tmp_path / "launcher.log"
    proc = start([*cmd, "fault_tolerance.wait_s=3"], worker_env(MF_TEST_STEP_SLEEP_S="0.5"), log)
    try:
        wait_for(lambda: len(_records(run_dir, 1)) >= 3, 240, f"group 1 to train 3 steps\n{logs(log)[-4000:]}")
        victim = _rank_pid(proc.pid, replica=1, rank=0)
        assert victim is not None, logs(log)[-4000:]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "replica group 0 had no quorum for" in logs(log), 120, f"group 0 to stop\n{logs(log)[-4000:]}")
        proc.send_signal(signal.SIGTERM)  # the launcher: no more restarts
    finally:
        finish([proc], 120)
    text = logs(log)
    assert "replica group 0 has no quorum (" in text and "wait_s=3s" in text, text[-6000:]
    assert "replica group 0 stops at step" in text and "with a checkpoint" in text, text[-6000:]
    saved = sorted((run_dir / "replica-0").rglob("step-*"))
    assert saved, f"group 0 saved no checkpoint\n{text[-4000:]}"

    log = tmp_path / "again.log"
    codes = finish([start([*cmd, "fault_tolerance.wait_s=120"], worker_env(), log)], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert f"resumed from {saved[-1]}" in text and "replica group 1 healed from a live peer" in text, text[-6000:]
    from safetensors.torch import load_file

    weights = [load_file(str(run_dir / f"replica-{r}" / "final" / "model.safetensors")) for r in range(GROUPS)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0]), "the groups' final weights differ"


@pytest.mark.slow
def test_a_stop_signal_to_one_group_stops_every_group_at_the_same_step(tmp_path):
    """2 groups x 1 rank: SIGTERM to group 0's rank only. Its agreement rides in the next step's cross-group
    all-reduce, so both groups stop after the same step and each commits a checkpoint of it."""
    run_dir = tmp_path / "run"
    config = [*overrides(tmp_path, run_dir), "train.steps=200", "logging.log_interval=1", "checkpoint.interval=0"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
           "--nproc-per-node", "1", "--set", *config]
    log = tmp_path / "launcher.log"
    proc = start(cmd, worker_env(MF_TEST_STEP_SLEEP_S="0.3"), log)

    def saved(r: int) -> list[Path]:  # committed checkpoints (a save in progress is step-N.partial)
        return sorted(p for p in (run_dir / f"replica-{r}").rglob("step-*") if p.suffix != ".partial")

    try:
        wait_for(lambda: min(len(_records(run_dir, r)) for r in range(GROUPS)) >= 3, 240,
                 f"both groups to train 3 steps\n{logs(log)[-4000:]}")
        victim = _rank_pid(proc.pid, replica=0, rank=0)
        assert victim is not None, logs(log)[-4000:]
        os.kill(victim, signal.SIGTERM)
        wait_for(lambda: all(saved(r) for r in range(GROUPS)), 120, f"both groups' checkpoints\n{logs(log)[-4000:]}")
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher: no restarts
        finish([proc], 120)
    text = logs(log)
    steps = [[path.name for path in saved(r)] for r in range(GROUPS)]
    assert steps[0] == steps[1] and len(steps[0]) == 1, f"{steps}\n{text[-4000:]}"
    assert "every replica group stops after step" in text and "(SIGTERM agreed in its all-reduce)" in text, text[-6000:]


@pytest.mark.slow
@pytest.mark.matrix  # the stop's ride in the all-reduce is the CI row above
def test_a_stop_signal_during_one_groups_evaluation_stops_every_group_at_the_same_step(tmp_path):
    """2 groups x 1 rank, an evaluation after step 4 whose batches take a while: SIGTERM to group 0's rank while it
    evaluates. Group 0 leaves the evaluation and sends the signal in step 5's all-reduce (which the evaluation has no
    part in), so both groups stop after step 5, each with a checkpoint of it, instead of group 0 alone after 4."""
    run_dir, mark = tmp_path / "run", tmp_path / "evaluating"
    config = [*overrides(tmp_path, run_dir), "train.steps=200", "logging.log_interval=1", "checkpoint.interval=0",
              "train.eval_interval=4", "train.eval_batches=4"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(GROUPS),
           "--nproc-per-node", "1", "--set", *config]
    log = tmp_path / "launcher.log"
    proc = start(cmd, worker_env(MF_TEST_SLOW_PHASE="eval", MF_TEST_SLOW_PHASE_S="1.5",
                                 MF_TEST_PHASE_MARK=str(mark)), log)

    def saved(r: int) -> list[str]:
        return sorted(p.name for p in (run_dir / f"replica-{r}").rglob("step-*") if p.suffix != ".partial")

    try:
        wait_for(mark.exists, 240, f"an evaluation to start\n{logs(log)[-4000:]}")
        victim = _rank_pid(proc.pid, replica=0, rank=0)
        assert victim is not None, logs(log)[-4000:]
        os.kill(victim, signal.SIGTERM)
        wait_for(lambda: all(saved(r) for r in range(GROUPS)), 120, f"both groups' checkpoints\n{logs(log)[-4000:]}")
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher: no restarts
        finish([proc], 120)
    text = logs(log)
    assert [saved(r) for r in range(GROUPS)] == [["step-00000005"]] * GROUPS, text[-6000:]
    assert "replica group 0 agreed on SIGTERM during the evaluation after step 4" in text, text[-6000:]
    assert "every replica group stops after step 5 (SIGTERM agreed in its all-reduce)" in text, text[-6000:]


@pytest.mark.slow
def test_a_commit_that_fails_on_rank_0_alone_is_skipped_by_every_rank_of_the_group(tmp_path):
    """1 group x 2 ranks (FSDP), a checkpoint every 2 steps, and rank 0 alone fails to commit step 4's folder: every
    rank learns it in the collective that ends the save, and the group skips that save with a line and trains on,
    instead of its other rank waiting in a barrier for parallel.timeout_s (300 s here); the run ends at
    train.steps with every other checkpoint committed."""
    run_dir = tmp_path / "run"
    config = [*overrides(tmp_path, run_dir), "train.steps=8", "checkpoint.interval=2", "parallel.dp_shard=2",
              "parallel.timeout_s=300", "fault_tolerance.timeout_s=300"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", "1", "--nproc-per-node",
           "2", "--set", *config]
    log = tmp_path / "launcher.log"
    codes = finish([start(cmd, worker_env(MF_TEST_COMMIT_FAIL_STEP="4"), log)], 200)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert "injected: rank 0 commits step 4" in text and "this save is skipped" in text, text[-6000:]
    from meshformer.checkpointing.directory import committed_steps

    assert committed_steps(run_dir / "replica-0" / "checkpoints") == [2, 6, 8], text[-4000:]


@pytest.mark.slow
def test_an_async_commit_that_fails_on_rank_0_alone_is_skipped_by_every_rank_of_the_group(tmp_path):
    """As above with checkpoint.async_save=true: the save thread of every rank learns in the collective that ends the
    save that rank 0 could not commit step 4, so every rank counts that save as failed (not rank 0 alone), the group
    skips it with one line and trains on, and the newest committed checkpoint (step 2) stays whole and loadable."""
    run_dir, outcome = tmp_path / "run", tmp_path / "failed"
    config = [*overrides(tmp_path, run_dir), "train.steps=8", "checkpoint.interval=2", "checkpoint.async_save=true",
              "parallel.dp_shard=2", "parallel.timeout_s=300", "fault_tolerance.timeout_s=300"]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", "1", "--nproc-per-node",
           "2", "--set", *config]
    log = tmp_path / "launcher.log"
    env = worker_env(MF_TEST_COMMIT_FAIL_STEP="4", MF_TEST_SAVE_OUTCOME=str(outcome), MF_TEST_SAVE_SLEEP_S="0.5")
    codes = finish([start(cmd, env, log)], 200)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert "injected: rank 0 commits step 4" in text, text[-6000:]
    warned = [line for line in text.splitlines() if "asynchronous save, skipped by every rank" in line]
    assert len(warned) == 1 and "replica group 0" in warned[0], text[-6000:]
    for rank in range(2):  # every rank concluded the same: step 4's save failed, and no other
        path = Path(f"{outcome}-rank{rank}")
        assert path.is_file() and path.read_text().split() == ["4"], f"rank {rank}\n{text[-4000:]}"
    from meshformer.checkpointing.dcp_io import read_full_tensors
    from meshformer.checkpointing.directory import committed_steps
    from meshformer.checkpointing.manifest import verify_manifest

    root = run_dir / "replica-0" / "checkpoints"
    assert committed_steps(root) == [2, 6, 8], text[-4000:]
    newest_at_failure = root / "step-00000002"
    verify_manifest(newest_at_failure, "sha256")
    assert read_full_tensors(newest_at_failure), "step 2's tensors could not be read"


# ----------------------------------------------------------------------------- edge cases (1 rank per group)


def _launch(tmp_path: Path, groups: int, steps: int, *extra: str, step_sleep: str = "0.4", **faults: str
            ) -> tuple[Path, subprocess.Popen, Path]:
    """`meshformer train tiny-gpt --replica-groups N --nproc-per-node 1`: (run folder, launcher, its log)."""
    run_dir = tmp_path / "run"
    config = [*overrides(tmp_path, run_dir), f"train.steps={steps}", "logging.log_interval=1", "checkpoint.interval=0",
              "fault_tolerance.heartbeat_timeout_s=1", "fault_tolerance.join_timeout_s=2", *extra]
    cmd = [sys.executable, "-m", "meshformer", "train", "tiny-gpt", "--replica-groups", str(groups),
           "--nproc-per-node", "1", "--set", *config]
    log = tmp_path / "launcher.log"
    return run_dir, start(cmd, worker_env(MF_TEST_STEP_SLEEP_S=step_sleep, **faults), log), log


def _kill(launcher: int, replica: int, signum: int = signal.SIGKILL) -> None:
    victim = _rank_pid(launcher, replica, rank=0)
    assert victim is not None, f"no rank of replica group {replica}"
    os.kill(victim, signum)


def _assert_complete(run_dir: Path, groups: int, steps: int, text: str) -> dict[int, list[dict]]:
    """Every group's final weights equal bit for bit; every step 1..steps recorded, once per group that trained
    it, at its data position, with the groups agreeing on who did. Returns the records by step."""
    from safetensors.torch import load_file

    weights = [load_file(str(run_dir / f"replica-{r}" / "final" / "model.safetensors")) for r in range(groups)]
    for r in range(1, groups):
        differ = [k for k in weights[0] if not torch.equal(weights[0][k], weights[r][k])]
        assert not differ, f"groups 0 and {r} end with different weights in {differ[:4]}\n{text[-4000:]}"
    by_step: dict[int, list[dict]] = {}
    for record in (r for g in range(groups) for r in _records(run_dir, g)):
        by_step.setdefault(record["step"], []).append(record)
    assert sorted(by_step) == list(range(1, steps + 1)), sorted(by_step)
    for step, lines in by_step.items():
        trained = sorted(line["replica"] for line in lines)
        assert len(set(trained)) == len(trained), f"step {step} recorded twice by one group: {lines}"
        assert all(line["replicas"] == trained for line in lines), f"step {step}: the groups disagree: {lines}"
        assert all(line["position"] == (step - 1) * groups * 4 for line in lines), lines  # x data.batch_size
    return by_step


@pytest.mark.slow
def test_a_group_killed_while_another_heals_from_it(tmp_path):
    """2 groups: group 1 killed; while it heals from group 0 after its restart, group 0 is killed too. Group 1 keeps
    the state it took, group 0 restarts and heals from it; both end at train.steps, equal. (Group 1 trains steps
    alone only where group 0's return on its warm ranks takes longer than the Lighthouse's join timeout.)"""
    steps, mark = 100, tmp_path / "healing"
    run_dir, proc, log = _launch(tmp_path, 2, steps, MF_TEST_HEAL_SLEEP_S="2", MF_TEST_HEAL_MARK=str(mark))
    try:
        wait_for(lambda: len(_records(run_dir, 1)) >= 3, 240, f"group 1 to train 3 steps\n{logs(log)[-4000:]}")
        mark.unlink(missing_ok=True)  # a group that started late healed already: the heal after the restart
        _kill(proc.pid, 1)
        wait_for(mark.exists, 120, f"group 1 to heal\n{logs(log)[-4000:]}")
        _kill(proc.pid, 0)
    finally:
        codes = finish([proc], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert "replica group 1 healed from a live peer" in text and "replica group 0 healed from a live peer" in text, \
        text[-6000:]
    by_step = _assert_complete(run_dir, 2, steps, text)
    trained_by = {tuple(sorted(line["replica"] for line in lines)) for lines in by_step.values()}
    assert {(0, 1)} < trained_by <= {(0,), (1,), (0, 1)}, trained_by  # and a group alone while the other was gone
    # the order of the heals: group 0's (after its kill) came after group 1's, from the state group 1 had taken
    assert text.index("replica group 1 healed from a live peer") < text.index("replica group 0 healed from a live peer")


@pytest.mark.slow
@pytest.mark.matrix
def test_two_groups_lost_at_once_the_third_trains_on_and_both_heal(tmp_path):
    """3 groups: groups 1 and 2 killed together. Group 0 trains alone, both restart and heal from it."""
    steps = 70
    run_dir, proc, log = _launch(tmp_path, 3, steps)
    try:
        wait_for(lambda: min(len(_records(run_dir, r)) for r in (1, 2)) >= 3, 240,
                 f"groups 1 and 2 to train 3 steps\n{logs(log)[-4000:]}")
        _kill(proc.pid, 1)
        _kill(proc.pid, 2)
    finally:
        codes = finish([proc], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert "replica group 1 healed from a live peer" in text and "replica group 2 healed from a live peer" in text, \
        text[-6000:]
    by_step = _assert_complete(run_dir, 3, steps, text)
    assert any(len(lines) == 1 for lines in by_step.values()), "group 0 never trained alone"
    assert len(by_step[steps]) == 3, by_step[steps]


@pytest.mark.slow
@pytest.mark.matrix
def test_the_lighthouse_restarted_the_groups_wait_with_a_line_and_go_on(tmp_path):
    """The Lighthouse (`meshformer lighthouse`) killed mid-run: both groups notice it at their next quorum and wait
    with a line; the same command again at the same address and the run goes on to train.steps, every step
    recorded."""
    steps, port = 30, free_port()
    lighthouse_cmd = [sys.executable, "-m", "meshformer", "lighthouse", "--bind", f"127.0.0.1:{port}", "--set",
                      "fault_tolerance.heartbeat_timeout_s=1", "fault_tolerance.join_timeout_s=2"]
    lighthouses = [start(lighthouse_cmd, worker_env(), tmp_path / "lighthouse-0.log")]
    # short timeouts: a group's first request to the new Lighthouse can stall until quorum_timeout_s, and a heal
    # assigned in it can wait timeout_s for a peer that went on alone
    run_dir, proc, log = _launch(tmp_path, 2, steps, f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
                                 "fault_tolerance.quorum_timeout_s=5", "fault_tolerance.timeout_s=10",
                                 step_sleep="0.3")
    try:
        wait_for(lambda: min(len(_records(run_dir, r)) for r in range(2)) >= 3, 240,
                 f"both groups to train 3 steps\n{logs(log)[-4000:]}")
        lighthouses[0].send_signal(signal.SIGKILL)
        wait_for(lambda: logs(log).count("cannot be reached") >= 2, 60, f"both groups to wait\n{logs(log)[-4000:]}")
        lighthouses.append(start(lighthouse_cmd, worker_env(), tmp_path / "lighthouse-1.log"))
        codes = finish([proc], 300)
    finally:
        finish([proc], 1)
        for lighthouse in lighthouses:
            lighthouse.send_signal(signal.SIGTERM)
        finish(lighthouses, 30)
    text = logs(log)
    assert codes == [0], text[-6000:]
    for r in range(2):
        assert f"replica group {r} has no quorum (" in text and f"replica group {r} has a quorum again" in text, \
            text[-6000:]
    # a group that reaches the new Lighthouse after join_timeout_s misses the steps until then and heals, as after
    # a drop; no step goes unrecorded
    _assert_complete(run_dir, 2, steps, text)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_stop_signal_during_a_heal_stops_every_group_at_one_step_and_the_run_resumes(tmp_path):
    """Group 1 killed; while it heals, SIGTERM to the launcher (to every rank). Both groups stop after the same
    step with a checkpoint; the same command again ends at train.steps, equal, with a complete record."""
    steps, mark = 80, tmp_path / "healing"
    run_dir, proc, log = _launch(tmp_path, 2, steps, MF_TEST_HEAL_SLEEP_S="2", MF_TEST_HEAL_MARK=str(mark))

    def saved(r: int) -> list[str]:
        return sorted(p.name for p in (run_dir / f"replica-{r}").rglob("step-*") if p.suffix != ".partial")

    try:
        wait_for(lambda: len(_records(run_dir, 1)) >= 3, 240, f"group 1 to train 3 steps\n{logs(log)[-4000:]}")
        mark.unlink(missing_ok=True)  # a group that started late healed already: the heal after the restart
        _kill(proc.pid, 1)
        wait_for(mark.exists, 120, f"group 1 to heal\n{logs(log)[-4000:]}")
        proc.send_signal(signal.SIGTERM)
    finally:
        finish([proc], 120)
    text = logs(log)
    assert saved(0) == saved(1) and len(saved(0)) == 1, f"{[saved(r) for r in range(2)]}\n{text[-4000:]}"
    assert "every replica group stops after step" in text, text[-6000:]

    again = tmp_path / "again"
    again.mkdir()
    # min_replicas=2: the groups resume together (one alone would train on from the checkpoint by itself)
    _, proc, log = _launch(again, 2, steps, f"logging.run_dir={run_dir}", "fault_tolerance.min_replicas=2",
                           step_sleep="0")
    codes = finish([proc], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    _assert_complete(run_dir, 2, steps, text)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_stopped_group_is_dropped_after_timeout_s_and_heals_after_sigcont(tmp_path):
    """Group 1 SIGSTOPped mid-run: group 0 drops it (its all-reduce gives up after fault_tolerance.timeout_s) and
    trains alone; after SIGCONT group 1 is behind, heals from group 0 and rejoins; both end equal."""
    steps = 70
    run_dir, proc, log = _launch(tmp_path, 2, steps, "fault_tolerance.timeout_s=4")
    try:
        wait_for(lambda: len(_records(run_dir, 1)) >= 3, 240, f"group 1 to train 3 steps\n{logs(log)[-4000:]}")
        _kill(proc.pid, 1, signal.SIGSTOP)
        stopped = time.monotonic()
        before = len(_records(run_dir, 0))
        wait_for(lambda: any(len(r["replicas"]) == 1 for r in _records(run_dir, 0)[before:]), 60,
                 f"group 0 to commit a step alone\n{logs(log)[-4000:]}")
        alone_after = time.monotonic() - stopped
        _kill(proc.pid, 1, signal.SIGCONT)
    finally:
        codes = finish([proc], 300)
    text = logs(log)
    assert codes == [0], text[-6000:]
    assert alone_after < 30, f"group 0 went on alone only {alone_after:.1f}s after the stop\n{text[-4000:]}"
    assert "replica group(s) [1] dropped" in text and "replica group(s) [1] joined" in text, text[-6000:]
    assert "replica group 1 healed from a live peer" in text and "restarting it" not in text, text[-6000:]
    _assert_complete(run_dir, 2, steps, text)


@pytest.mark.slow
@pytest.mark.matrix
def test_a_stop_signal_with_local_sgd_stops_every_group_at_the_next_synchronisation(tmp_path):
    """2 groups, method=local_sgd, sync_every=3: SIGTERM to group 0's rank only. Its agreement rides in the next
    synchronisation, and both groups stop there, each with a checkpoint of that step holding the same weights."""
    from meshformer.checkpointing.dcp_io import read_full_tensors
    from meshformer.checkpointing.state import OPTIM

    run_dir, proc, log = _launch(tmp_path, 2, 200, "fault_tolerance.method=local_sgd", "fault_tolerance.sync_every=3",
                                 step_sleep="0.3")

    def saved(r: int) -> list[Path]:
        return sorted(p for p in (run_dir / f"replica-{r}").rglob("step-*") if p.suffix != ".partial")

    try:
        wait_for(lambda: min(len(_records(run_dir, r)) for r in range(2)) >= 4, 240,
                 f"both groups to train 4 steps\n{logs(log)[-4000:]}")
        _kill(proc.pid, 0, signal.SIGTERM)
        wait_for(lambda: all(saved(r) for r in range(2)), 120, f"both groups' checkpoints\n{logs(log)[-4000:]}")
    finally:
        proc.send_signal(signal.SIGTERM)  # the launcher: no restarts
        finish([proc], 120)
    text = logs(log)
    paths = [saved(r) for r in range(2)]
    assert [p.name for p in paths[0]] == [p.name for p in paths[1]] and len(paths[0]) == 1, f"{paths}\n{text[-4000:]}"
    assert int(paths[0][0].name.split("-")[1]) % 3 == 0, paths
    assert "(SIGTERM agreed in the synchronisation)" in text, text[-6000:]
    tensors = [read_full_tensors(p[0]) for p in paths]
    weights = [k for k in tensors[0] if not k.startswith(OPTIM)]  # each group's own optimizer moments differ
    assert weights
    differ = [k for k in weights if not torch.equal(tensors[0][k], tensors[1][k])]
    assert not differ, f"the groups stopped with different weights in {differ[:4]}"
