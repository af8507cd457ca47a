"""`meshformer submit`: the sbatch script, its errors, and a 2-node job on a real SLURM scheduler that is sent
the pre-timeout signal, checkpoints, requeues itself, resumes and ends with the uninterrupted run's weights.

The scheduler is Debian's slurmctld + two slurmd on this machine (tools/slurm/start.sh; .ci/run starts it).
Without sbatch the scheduler tests skip, except under CI, where they fail.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers.cluster import (
    CLUSTER_STEPS,
    CONFIG,
    INJECT,
    ROOT,
    assert_same_weights,
    overrides,
    reference_run,
    wait_for,
)

from meshformer.checkpointing.directory import committed_steps
from meshformer.cli import main
from meshformer.launcher import slurm as slurm_module
from meshformer.launcher.slurm import SlurmJob, SubmitError, sbatch_script, submit
from meshformer.launcher.torchrun import torchrun_command

TOOLS = ROOT / "tools" / "slurm"


def _scheduler_up() -> bool:
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.fixture(scope="module")
def slurm():
    """A running scheduler: the one already up, or the local two-node cluster started (and stopped) here."""
    if shutil.which("sbatch") is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but sbatch is missing: .ci/run must install slurmctld slurmd slurm-client munge "
                        "and run tools/slurm/start.sh before the tests")
        pytest.skip("sbatch is not installed (these run in CI; locally: apt-get install slurmctld slurmd "
                    "slurm-client munge, then tools/slurm/start.sh)")
    started = False
    if not _scheduler_up():
        if os.geteuid() != 0:
            pytest.fail("sbatch is installed but no SLURM controller answers; as root, run tools/slurm/start.sh")
        subprocess.run([str(TOOLS / "start.sh")], check=True, timeout=120)
        started = True
    yield
    if started:
        subprocess.run([str(TOOLS / "stop.sh")], timeout=120)


def _job_state(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


# ----------------------------------------------------------------------------- the script


def test_dry_run_prints_a_requeueing_multi_node_script(tmp_path, capsys):
    run_dir = tmp_path / "run"
    main(["submit", CONFIG, "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu", "--time", "04:00:00",
          "--account", "proj", "--setup", "source /opt/venv/bin/activate", "--dry-run",
          "--set", f"logging.run_dir={run_dir}", "checkpoint.interval=100"])
    printed = capsys.readouterr()
    script = printed.out
    assert "warning" not in printed.err  # checkpoints every 100 steps: a requeue loses nothing
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "#SBATCH --account=proj", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@120", f"#SBATCH --output={run_dir}/slurm/job-%j.out",
                 "source /opt/venv/bin/activate", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                 'scontrol requeue "$SLURM_JOB_ID"']:
        assert line in script, line
    # srun runs exactly the launcher's torchrun command (c10d rendezvous on the first node), once per node.
    srun = script[script.index("\nsrun "):script.index(" &\n")].replace("\\\n", " ")
    args = shlex.split(srun)
    launched = args[args.index("--open-mode=append") + 1:]
    job_overrides = [f"logging.run_dir={run_dir}", "checkpoint.interval=100", f"logging.run_dir={run_dir.resolve()}"]
    expected = torchrun_command(str(Path(CONFIG).resolve()), job_overrides, nproc_per_node=8, nnodes=4,
                                rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT", rdzv_id="$SLURM_JOB_ID", max_restarts=3)
    assert launched == expected
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    assert not run_dir.exists()  # a dry run writes nothing


def _replica_script(tmp_path, capsys, *options: str) -> str:
    main(["submit", CONFIG, "--nodes", "4", "--replica-groups", "2", "--nproc-per-node", "2", *options, "--dry-run",
          "--set", f"logging.run_dir={tmp_path / 'run'}", "checkpoint.interval=100"])
    return capsys.readouterr().out


def test_replica_groups_script_has_a_lighthouse_a_step_per_group_and_a_restart_loop(tmp_path, capsys):
    script = _replica_script(tmp_path, capsys)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    for line in ["#SBATCH --nodes=4", "#SBATCH --no-kill", "#SBATCH --requeue",
                 'export TORCHFT_LIGHTHOUSE="http://$HEAD_ADDR:$LIGHTHOUSE_PORT"',
                 "srun --overlap --nodes=1 --ntasks=1 --relative=0", "-m meshformer lighthouse",
                 '--bind "[::]:$LIGHTHOUSE_PORT"',
                 "MESHFORMER_REPLICA_ID=$r srun --kill-on-bad-exit=1 --nodes=2 --ntasks=2",
                 "--relative=$(( r * 2 ))", "for r in $(seq 0 1); do", 'elif [ "$restarts" -ge 3 ]']:
        assert line in script, line
    # each group is one torchrun job of 2 nodes with its own rendezvous, restarted whole by the loop (not torchrun)
    assert "--nnodes=2" in script and '--rdzv-endpoint="$GROUP_ADDR:$RDZV_PORT"' in script
    assert "--max-restarts" not in script.split("run_group()")[1].split("status=$?")[0]
    assert "fault_tolerance.enabled=true fault_tolerance.replica_groups=2" in script
    assert "--no-kill" not in _plain_script(tmp_path, capsys)  # a job without groups is unchanged: one node ends it


def _plain_script(tmp_path, capsys) -> str:
    main(["submit", CONFIG, "--nodes", "4", "--dry-run", "--set", f"logging.run_dir={tmp_path / 'run'}"])
    return capsys.readouterr().out


_FAKE_SRUN = """#!/bin/bash
if [[ "$*" == *" lighthouse "* ]]; then  # the Lighthouse: a listening port is all the script waits for
  exec {python} -c "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', $LIGHTHOUSE_PORT)); s.listen(); \\
time.sleep(60)"
fi
echo "$MESHFORMER_REPLICA_ID $TORCHFT_LIGHTHOUSE $*" >> "$FAKE_LOG"
if [ "$MESHFORMER_REPLICA_ID" = 0 ]; then sleep 4; exit 0; fi  # group 0 trains to the end
exit 7  # group 1 fails every time it starts
"""
_FAKE_SCONTROL = """#!/bin/bash
case "$2" in
  hostnames) printf 'n0\\nn1\\nn2\\nn3\\n' ;;
  node) [ "$3" = n0 ] && echo "NodeName=n0 NodeAddr=127.0.0.1 State=IDLE" \\
          || echo "NodeName=$3 NodeAddr=10.0.0.${{3#n}}" ;;
esac
"""


@pytest.mark.slow
def test_replica_groups_script_restarts_a_failed_group_alone(tmp_path, capsys):
    """The script itself, run by bash with a fake srun and scontrol: group 1 fails every time and is restarted
    --max-restarts times while group 0 runs on once; the job ends 0 because group 0 reached train.steps."""
    import random
    import socket
    import sys

    script = _replica_script(tmp_path, capsys, "--max-restarts", "2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(_FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(_FAKE_SCONTROL.format())
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    for _ in range(50):  # a job id whose Lighthouse port (28500 + id % 1000) is free here
        job_id = random.randrange(1000)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", 28500 + job_id)) != 0:
                break
    log = tmp_path / "srun.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(job_id),
           "SLURM_JOB_NODELIST": "n[0-3]", "FAKE_LOG": str(log), "LIGHTHOUSE_PORT": str(28500 + job_id)}
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = log.read_text().splitlines()
    by_group = {r: [line for line in steps if line.startswith(f"{r} ")] for r in (0, 1)}
    assert len(by_group[0]) == 1 and len(by_group[1]) == 3, steps  # the first run and 2 restarts
    for line in steps:
        assert f"http://127.0.0.1:{28500 + job_id} " in line  # the Lighthouse on the first node
    assert "--relative=2" in by_group[1][0] and "--rdzv-endpoint=10.0.0.2:" in by_group[1][0]
    assert f"--rdzv-id={job_id}-1" in by_group[1][0] and "--relative=0" in by_group[0][0]
    assert "replica group 1 exited with status 7; restarting it (restart 2)" in done.stdout
    assert "replica group 1 exited with status 7; not restarted (2 restarts (--max-restarts))" in done.stdout
    assert "replica group 0 reached train.steps" in done.stdout and "training exited with status 0" in done.stdout


def test_settings_that_lose_work_on_requeue_are_warned_about(tmp_path, capsys):
    main(["submit", CONFIG, "--dry-run", "--set", f"logging.run_dir={tmp_path}", "checkpoint.interval=0"])
    assert "warning: checkpoint.interval=0: a requeued or restarted job starts again from step 0" in \
        capsys.readouterr().err


def test_submit_loads_the_config_once(tmp_path, capsys, monkeypatch):
    loads = []
    load = slurm_module.load_config
    monkeypatch.setattr(slurm_module, "load_config", lambda *args: loads.append(args) or load(*args))
    main(["submit", CONFIG, "--nodes", "2", "--dry-run", "--set", f"logging.run_dir={tmp_path}"])
    assert "#SBATCH --nodes=2" in capsys.readouterr().out and len(loads) == 1


def test_missing_sbatch_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    job = SlurmJob(CONFIG, [f"logging.run_dir={tmp_path / 'run'}"], nodes=2)
    with pytest.raises(SubmitError, match="sbatch not found on PATH.*--dry-run"):
        submit(job)
    with pytest.raises(SystemExit, match="^error: sbatch not found"):
        main(["submit", CONFIG, "--nodes", "2", "--set", f"logging.run_dir={tmp_path / 'run'}"])


def test_bad_node_counts_and_config_errors_stop_before_submission(tmp_path):
    with pytest.raises(SubmitError, match="--nodes"):
        sbatch_script(SlurmJob(CONFIG, [f"logging.run_dir={tmp_path}"], nodes=0))
    with pytest.raises(SystemExit, match="^error: unknown config key 'train.step'"):
        main(["submit", CONFIG, "--dry-run", "--set", "train.step=5"])


# ----------------------------------------------------------------------------- a real scheduler


def test_unknown_partition_is_a_clear_error(slurm, tmp_path):
    job = SlurmJob(CONFIG, [f"logging.run_dir={tmp_path / 'run'}"], nodes=2, partition="no-such-partition")
    with pytest.raises(SubmitError, match=r"partition 'no-such-partition' does not exist.*available: \S+"):
        submit(job)


@pytest.mark.slow  # ~1 min; with the other cluster runs (test_cluster_torchrun.py), sharing their reference run
def test_two_node_job_checkpoints_requeues_and_resumes_at_the_time_limit_signal(slurm, tmp_path_factory, tmp_path):
    base = tmp_path_factory.getbasetemp()
    reference = reference_run(base)
    run_dir = tmp_path / "run"
    # Slow steps (test-only sitecustomize, see tests/helpers/cluster_inject) leave time to signal mid-run.
    job = SlurmJob(CONFIG, overrides(base, run_dir), nodes=2, gpus_per_node=0, nproc_per_node=1, max_restarts=0,
                   setup=[f"export PYTHONPATH={INJECT}:{ROOT} MF_TEST_STEP_SLEEP_S=0.2 OMP_NUM_THREADS=1"])
    _, job_id = submit(job)
    batch_log, node_logs = run_dir / "slurm" / f"job-{job_id}.out", run_dir / "slurm" / f"job-{job_id}"
    try:
        wait_for(lambda: committed_steps(run_dir / "checkpoints"), 120, "the job's first checkpoint", poll=0.1)
        # What SLURM does ahead of the time limit with --signal=B:USR1@120: signal the batch script.
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True)

        requeued_at: list[float] = []

        def finished() -> bool:
            state = _job_state(job_id)
            if state.get("JobState") == "PENDING" and state.get("Restarts") == "1":
                # SLURM holds a requeued job for 2 minutes before it may start again; skip the wait, but only
                # after 3 s: a start within the second the old credential was revoked is refused by slurmd.
                requeued_at[:] = requeued_at or [time.monotonic()]
                if time.monotonic() - requeued_at[0] > 3:
                    subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], capture_output=True)
            return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")

        wait_for(finished, 240, f"job {job_id} to finish", poll=0.5)
    finally:
        if _job_state(job_id).get("JobState") in ("PENDING", "RUNNING"):
            subprocess.run(["scancel", job_id])
    state = _job_state(job_id)
    text = batch_log.read_text() + "".join(p.read_text(errors="replace") for p in sorted(node_logs.glob("*.log")))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", f"{state}\n{text[-6000:]}"
    assert "time limit near" in text and "requeueing job" in text and "(restart 1)" in text, text[-4000:]
    saved = re.search(r"stopped by SIGTERM after step (\d+)/\d+: checkpoint \S+ committed", text)
    resumed = re.search(r"resumed from \S+ \(step (\d+)", text)
    assert saved and resumed, text[-4000:]
    assert int(saved.group(1)) == int(resumed.group(1)) < CLUSTER_STEPS  # stopped mid-run, resumed right there
    assert committed_steps(run_dir / "checkpoints")[-1] == CLUSTER_STEPS
    assert f"step {CLUSTER_STEPS:>6}/{CLUSTER_STEPS}" in text
    assert_same_weights(run_dir, reference)


@pytest.mark.slow  # ~1 min; shares the cluster tests' reference run
def test_a_preempted_two_node_job_saves_is_requeued_and_resumes_bitwise(slurm, tmp_path_factory, tmp_path):
    """A job of the "urgent" partition needs both nodes: SLURM preempts the training job (SIGTERM to all its
    processes, GraceTime before SIGKILL) and requeues it; the ranks stop after the same step with its checkpoint,
    and the requeued job resumes there and ends with the uninterrupted run's weights."""
    base = tmp_path_factory.getbasetemp()
    reference = reference_run(base)
    run_dir = tmp_path / "run"
    job = SlurmJob(CONFIG, overrides(base, run_dir), nodes=2, gpus_per_node=0, nproc_per_node=1, max_restarts=0,
                   partition="debug",
                   setup=[f"export PYTHONPATH={INJECT}:{ROOT} MF_TEST_STEP_SLEEP_S=0.3 OMP_NUM_THREADS=1"])
    _, job_id = submit(job)
    batch_log, node_logs = run_dir / "slurm" / f"job-{job_id}.out", run_dir / "slurm" / f"job-{job_id}"
    urgent = None
    try:
        wait_for(lambda: committed_steps(run_dir / "checkpoints"), 120, "the job's first checkpoint", poll=0.1)
        urgent = subprocess.run(["sbatch", "--parsable", "--partition=urgent", "--nodes=2", "--exclusive",
                                 f"--output={tmp_path / 'urgent.out'}", "--wrap", "sleep 1"],
                                capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
        requeued_at: list[float] = []

        def finished() -> bool:
            state = _job_state(job_id)
            if state.get("JobState") == "PENDING" and state.get("Restarts") == "1" and \
                    _job_state(urgent).get("JobState") not in ("PENDING", "RUNNING"):
                requeued_at[:] = requeued_at or [time.monotonic()]
                if time.monotonic() - requeued_at[0] > 3:  # skip SLURM's hold of a requeued job (see above)
                    subprocess.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], capture_output=True)
            return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")

        wait_for(finished, 300, f"job {job_id} to be preempted, requeued and finished", poll=0.5)
    finally:
        for job_ in (job_id, urgent):
            if job_ and _job_state(job_).get("JobState") in ("PENDING", "RUNNING"):
                subprocess.run(["scancel", job_])
    state = _job_state(job_id)
    text = batch_log.read_text() + "".join(p.read_text(errors="replace") for p in sorted(node_logs.glob("*.log")))
    assert state.get("JobState") == "COMPLETED" and state.get("Restarts") == "1", f"{state}\n{text[-6000:]}"
    assert _job_state(urgent).get("JobState") == "COMPLETED"
    saved = re.search(r"stopped by SIGTERM after step (\d+)/\d+: checkpoint \S+ committed", text)
    resumed = re.search(r"resumed from \S+ \(step (\d+)", text)
    assert saved and resumed, text[-4000:]
    assert int(saved.group(1)) == int(resumed.group(1)) < CLUSTER_STEPS  # stopped mid-run, resumed right there
    assert committed_steps(run_dir / "checkpoints")[-1] == CLUSTER_STEPS
    assert_same_weights(run_dir, reference)
