"""A stop signal ends a multi-rank run as a scheduler or a terminal sends it, with steps of seconds: every rank stops
after the same step, that step's checkpoint is committed, the launcher exits 128+signal without a traceback, and
the resumed run ends with the uninterrupted run's weights, bitwise.

Signals go to the launcher (`meshformer train --nproc-per-node`), to every rank, or to every process group (the
launcher's and each rank's: torchrun starts the ranks in sessions of their own), at a random point of a random step,
during a periodic blocking save or during an asynchronous one (a save held open before its commit).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers import cluster

from meshformer.checkpointing.directory import committed_steps, read_latest, step_dir_name
from meshformer.launcher.torchrun import torchrun_env
from meshformer.runtime.stop import REPEAT_WINDOW_S

STEPS = 12
STEP_SLEEP_S = 2.0  # "steps of several seconds": a stop must not depend on fast steps
SAVE_SLEEP_S = 4.0  # a save held open before its commit, to signal into
STOPPED = re.compile(rf"stopped by (SIG\w+) after step (\d+)/{STEPS}: checkpoint (\S+) committed")
_REFERENCES: dict[int, Path] = {}


def test_the_agent_takes_every_stop_signal_and_waits_the_grace_period(monkeypatch):
    """torchrun's agent handles only SIGTERM, SIGINT, SIGHUP and SIGQUIT by default and kills the ranks 30 s after
    one: SLURM's --signal (SIGUSR1/2) would kill the agent, and a slow save would be cut off."""
    from torch.distributed.run import parse_args

    for key, value in torchrun_env(2, grace_s=777).items():
        monkeypatch.setenv(key, value)
    args = parse_args(["--standalone", "--nproc-per-node=2", "-m", "meshformer.train", "x.toml"])
    assert {"SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"} <= set(args.signals_to_handle.split(","))
    assert os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "777"


def _overrides(base: Path, run_dir: Path, *extra: str) -> list[str]:
    return cluster.overrides(base, run_dir, "logging.log_interval=1", f"train.steps={STEPS}", *extra)


def _launch(base: Path, run_dir: Path, world: int, *extra: str, **faults: str):
    env = cluster.worker_env(**faults)
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")  # the launcher sets its own grace period
    env.pop("MESHFORMER_DEBUG", None)
    cmd = [sys.executable, "-m", "meshformer.cli", "train", cluster.CONFIG, "--nproc-per-node", str(world),
           "--set", *_overrides(base, run_dir, *extra)]
    log = run_dir.parent / f"{run_dir.name}-{len(list(run_dir.parent.glob(run_dir.name + '-*.log')))}.log"
    return cluster.start(cmd, env, log), log


def _reference(base: Path, world: int) -> Path:
    """An uninterrupted run of the same job (once per world size and session)."""
    if world not in _REFERENCES:
        run_dir = base / f"stop-reference-{world}"
        proc, log = _launch(base, run_dir, world)
        assert cluster.finish([proc], 300) == [0], log.read_text()[-4000:]
        _REFERENCES[world] = run_dir
    return _REFERENCES[world]


def _logged_step(log: Path) -> int:
    steps = re.findall(rf"step +(\d+)/{STEPS} \|", log.read_text(errors="replace"))
    return int(steps[-1]) if steps else 0


def _send(proc, target: str, sig: int) -> None:
    ranks = cluster.children(proc.pid)
    if target == "launcher":
        os.kill(proc.pid, sig)
    elif target == "ranks":
        for pid in ranks:
            os.kill(pid, sig)
    else:  # what a terminal or a scheduler may do: every process group of the job
        for group in {os.getpgid(pid) for pid in (proc.pid, *ranks)}:
            os.killpg(group, sig)


def _resume_and_compare(base: Path, run_dir: Path, world: int, stopped_at: int) -> None:
    proc, log = _launch(base, run_dir, world)
    assert cluster.finish([proc], 300) == [0], log.read_text()[-4000:]
    text = log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / step_dir_name(stopped_at)} (step {stopped_at}," in text, \
        text[-3000:]
    cluster.assert_same_weights(run_dir, _reference(base, world))


CASES = [
    pytest.param(2, "launcher", "SIGTERM", "step", id="world2-launcher-SIGTERM-step"),
    pytest.param(2, "launcher", "SIGINT", "save", id="world2-launcher-SIGINT-save", marks=pytest.mark.slow),
    pytest.param(2, "ranks", "SIGUSR1", "step", id="world2-ranks-SIGUSR1-step", marks=pytest.mark.slow),
    pytest.param(2, "groups", "SIGINT", "step", id="world2-groups-SIGINT-step", marks=pytest.mark.slow),
    pytest.param(2, "launcher", "SIGTERM", "async", id="world2-launcher-SIGTERM-async", marks=pytest.mark.slow),
    pytest.param(2, "ranks", "SIGTERM", "save", id="world2-ranks-SIGTERM-save", marks=pytest.mark.slow),
    pytest.param(2, "groups", "SIGUSR2", "async", id="world2-groups-SIGUSR2-async", marks=pytest.mark.slow),
    pytest.param(4, "launcher", "SIGTERM", "step", id="world4-launcher-SIGTERM-step", marks=pytest.mark.slow),
    pytest.param(4, "groups", "SIGUSR1", "save", id="world4-groups-SIGUSR1-save", marks=pytest.mark.slow),
    pytest.param(4, "ranks", "SIGINT", "async", id="world4-ranks-SIGINT-async", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world, target, signame, when", CASES)
def test_a_stop_signal_commits_the_agreed_step_and_resumes_bitwise(tmp_path_factory, world, target, signame, when):
    base = tmp_path_factory.getbasetemp()
    run_dir = tmp_path_factory.mktemp("stop") / "run"
    rng = random.Random(f"{world}-{target}-{signame}-{when}")  # varied across cases, the same on every rerun
    sig = getattr(signal, signame)
    faults = {"MF_TEST_STEP_SLEEP_S": str(STEP_SLEEP_S)}
    # a signal to every process group reaches the DataLoader workers too: they must leave the stop to their rank
    extra: list[str] = ["data.num_workers=1"] if target == "groups" else []
    if when != "step":
        faults["MF_TEST_SAVE_SLEEP_S"] = str(SAVE_SLEEP_S)
        extra += ["checkpoint.async_save=true"] if when == "async" else []
    proc, log = _launch(base, run_dir, world, *extra, **faults)
    try:
        if when == "step":
            at = rng.randint(2, 7)
            cluster.wait_for(lambda: _logged_step(log) >= at, 300, f"step {at}", poll=0.1)
            time.sleep(rng.uniform(0, STEP_SLEEP_S))  # anywhere in the next step
        else:  # rank 0 holds the save of step 4 open before its commit
            partial = run_dir / "checkpoints" / (step_dir_name(4) + ".partial")
            cluster.wait_for(partial.exists, 300, "the save of step 4", poll=0.05)
            time.sleep(rng.uniform(0.5, SAVE_SLEEP_S / 2))
        signalled_after = _logged_step(log)
        _send(proc, target, sig)
        sent = time.monotonic()
        codes = cluster.finish([proc], 300)
        took = time.monotonic() - sent
    finally:
        cluster.kill_tree(proc.pid)
    text = log.read_text(errors="replace")
    assert codes == [128 + sig], (codes, text[-4000:])
    assert "Traceback" not in text and "Exception" not in text and "error" not in text.lower(), text[-4000:]
    stopped = STOPPED.findall(text)
    assert len(stopped) == 1 and stopped[0][0] == signame, text[-3000:]
    step = int(stopped[0][1])
    # the ranks agreed on one step within a step of the exchange that carried the flag, and committed it
    assert signalled_after <= step <= signalled_after + 3 and step < STEPS, (signalled_after, step)
    root = run_dir / "checkpoints"
    assert read_latest(root) == step_dir_name(step) and step in committed_steps(root)
    assert Path(stopped[0][2]) == run_dir / "checkpoints" / step_dir_name(step)
    if when != "step":
        assert 4 in committed_steps(run_dir / "checkpoints")  # the save signalled into committed too
    assert not (run_dir / "final").exists()
    _resume_and_compare(base, run_dir, world, step)
    print(f"\nstop: world {world}, {signame} to {target} during {when}: signalled after step {signalled_after}, "
          f"stopped after step {step}, exit {codes[0]}, {took:.1f}s from signal to exit, resumed bitwise")


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_keeps_the_last_committed_checkpoint(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    run_dir = tmp_path_factory.mktemp("stop-twice") / "run"
    root = run_dir / "checkpoints"
    faults = {"MF_TEST_STEP_SLEEP_S": str(STEP_SLEEP_S), "MF_TEST_STOP_SAVE_SLEEP_S": "60"}
    proc, log = _launch(base, run_dir, 2, "checkpoint.interval=2", **faults)
    try:
        cluster.wait_for(lambda: 2 in committed_steps(root), 300, "the checkpoint of step 2", poll=0.1)
        os.kill(proc.pid, signal.SIGTERM)
        cluster.wait_for(lambda: "SIGTERM received" in log.read_text(), 60, "the stop request", poll=0.05)
        committed = set(committed_steps(root))
        # the stop's save is held open for 60 s before its commit
        cluster.wait_for(lambda: any(int(p.name.split("-")[1].split(".")[0]) not in committed
                                     for p in root.glob("step-*.partial")), 120, "the stop's save", poll=0.05)
        time.sleep(REPEAT_WINDOW_S + 0.5)  # a second request, not the first one delivered twice
        committed = set(committed_steps(root))
        os.kill(proc.pid, signal.SIGTERM)
        started = time.monotonic()
        codes = cluster.finish([proc], 120)
        took = time.monotonic() - started
    finally:
        cluster.kill_tree(proc.pid)
    text = log.read_text(errors="replace")
    assert codes == [128 + signal.SIGTERM] and took < 30, (codes, took, text[-4000:])
    assert "SIGTERM again: stopped at once without saving" in text, text[-3000:]
    assert "Traceback" not in text and "Exception" not in text and not STOPPED.search(text), text[-4000:]
    assert set(committed_steps(root)) == committed and read_latest(root) == step_dir_name(max(committed))
    _resume_and_compare(base, run_dir, 2, max(committed))


@pytest.mark.slow
def test_ranks_whose_launcher_is_killed_stop_with_a_checkpoint(tmp_path_factory):
    """`kill -9` of the launcher: its ranks get SIGTERM from the kernel, save, and exit instead of training on."""
    base = tmp_path_factory.getbasetemp()
    run_dir = tmp_path_factory.mktemp("orphans") / "run"
    proc, log = _launch(base, run_dir, 2, MF_TEST_STEP_SLEEP_S=str(STEP_SLEEP_S))
    try:
        cluster.wait_for(lambda: _logged_step(log) >= 3, 300, "step 3", poll=0.1)
        ranks = cluster.children(proc.pid)
        assert len(ranks) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        cluster.wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 120, "the ranks to exit")
    finally:
        cluster.kill_tree(proc.pid)
    text = log.read_text(errors="replace")
    stopped = STOPPED.findall(text)
    assert len(stopped) == 1 and stopped[0][0] == "SIGTERM", text[-3000:]
    step = int(stopped[0][1])
    assert step < STEPS and read_latest(run_dir / "checkpoints") == step_dir_name(step)
    assert not (run_dir / "final").exists()
    _resume_and_compare(base, run_dir, 2, step)


# A stop during a long phase between two steps: each launch resumes the last and is signalled in the next phase,
# which every batch of it slows to its seconds: about a minute to run whole, far longer than a prompt stop takes.
# The other phases (samples, the init-from load, the set-up, the final weights) in one process:
# test_stop_phases.py.
PHASES = [  # (phase, signal, target, step it happens after, seconds per batch)
    ("eval", "SIGTERM", "launcher", 2, 0.5),  # 120 held-out batches
    ("downstream", "SIGINT", "groups", 4, 0.75),  # 80 scoring batches per rank
]
PHASE_STEPS = 6
PROMPT_S = 30.0  # from the signal to the exit: a batch or two, the stop's save and the exit


@pytest.mark.slow
def test_a_stop_during_a_long_phase_commits_within_a_batch(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    work = tmp_path_factory.mktemp("stop-phases")
    run_dir = work / "run"
    root = run_dir / "checkpoints"
    every_two = ["train.eval_interval=2", "train.eval_batches=120", "train.sample_interval=2",
                 'downstream.tasks=["bundled:kjv_cloze"]', "downstream.interval=2", "downstream.batch_size=1"]
    report = []
    for phase, signame, target, at, seconds in PHASES:
        mark = work / f"{phase}-started"
        sig = getattr(signal, signame)
        extra = [*every_two, f"train.steps={PHASE_STEPS}", *(["data.num_workers=1"] if target == "groups" else [])]
        proc, log = _launch(base, run_dir, 2, *extra, MF_TEST_SLOW_PHASE=phase, MF_TEST_SLOW_PHASE_S=str(seconds),
                            MF_TEST_PHASE_MARK=str(mark))
        try:
            cluster.wait_for(mark.exists, 300, f"the {phase} phase", poll=0.05)
            time.sleep(seconds * 1.5)  # well inside it
            _send(proc, target, sig)
            sent = time.monotonic()
            codes = cluster.finish([proc], 300)
            took = time.monotonic() - sent
        finally:
            cluster.kill_tree(proc.pid)
        text = log.read_text(errors="replace")
        assert codes == [128 + sig] and took < PROMPT_S, (phase, codes, took, text[-4000:])
        assert "Traceback" not in text and "error" not in text.lower(), text[-4000:]
        stopped = re.findall(rf"stopped by (SIG\w+) after step (\d+)/{PHASE_STEPS}: checkpoint (\S+) committed", text)
        assert len(stopped) == 1 and stopped[0][:2] == (signame, str(at)), (phase, text[-3000:])
        assert read_latest(root) == step_dir_name(at) and Path(stopped[0][2]) == root / step_dir_name(at)
        assert f"{phase:<5} {at:>6} |" not in text  # the phase was left unfinished (it logs nothing)
        assert phase == "eval" or f"eval  {at:>6} |" in text  # downstream scoring follows the held-out loss
        report.append(f"{phase} {took:.1f}s")
    print("\nstop during a phase, signal to exit: " + ", ".join(report))
