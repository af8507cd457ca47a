"""`meshformer submit CONFIG --nodes N --gpus-per-node G`: an sbatch script that survives preemption and time limits.

The script runs one srun task per node; each task is the torchrun command `meshformer train --nnodes` uses
(meshformer.launcher.torchrun), joined by a c10d rendezvous on the first node of the allocation. Logs go to
`<run_dir>/slurm/`: the batch script's own log `job-<id>.out` and one log per node in `job-<id>/`.

Surviving interruptions, without losing work:
- SLURM's pre-timeout signal (`--signal=B:USR1@S`) reaches the batch script, which sends SIGTERM to the
  training processes: they finish the step, save a checkpoint and exit; the script then requeues the job.
- Preemption (SIGTERM to everything) takes the same save path; SLURM requeues the job itself (`--requeue`).
  The partition's GraceTime must cover the save (`checkpoint.stop_grace_s`, sized to the checkpoint by default).
- A requeued job starts the same script again and the trainer resumes from the newest valid checkpoint.
- A failed worker (killed, OOM) is restarted by torchrun (`--max-restarts`) inside the allocation.

With `--replica-groups N` the nodes split into N fault-tolerant replica groups, each its own torchrun job, plus
a Lighthouse step; a failed group is restarted alone (meshformer/launcher/slurm_replicas.py).
"""

from __future__ import annotations

import datetime
import functools
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from meshformer.config import Config, load_config
from meshformer.errors import SubmitError
from meshformer.launcher.replica_groups import replica_overrides
from meshformer.launcher.slurm_replicas import (
    GROUP_RDZV_ENDPOINT,
    GROUP_RDZV_ID,
    LIGHTHOUSE_BIND,
    check_replica_split,
    replica_groups_launch,
)
from meshformer.launcher.torchrun import (
    AGENT_SIGNAL_NAMES,
    SAFE_PYTHON,
    check_world_size,
    stop_grace_s,
    torchrun_command,
)
from meshformer.parallel_dims import validate_parallel

# Shell variables in the torchrun command: resolved on the nodes, not when the script is written.
_RDZV_ENDPOINT = "@RDZV_ENDPOINT@"
_RDZV_ID = "@RDZV_ID@"

# sbatch's forms (man sbatch): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; and no limit.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)  # megabytes, or a K/M/G/T suffix
_HEADER_UNSAFE = re.compile(r"[\s'\"\\#$`;]")  # would split, end or inject a line of the script


@dataclass
class SlurmJob:
    config: str
    overrides: list[str] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU job
    nproc_per_node: int | None = None  # ranks per node; None: gpus_per_node, or 1 on CPU
    partition: str | None = None
    time: str | None = None  # SLURM time limit, e.g. "04:00:00"
    account: str | None = None
    qos: str | None = None
    cpus_per_task: int | None = None  # CPUs for the node's torchrun and all its ranks
    mem: str | None = None
    job_name: str | None = None
    setup: list[str] = field(default_factory=list)  # shell lines before torchrun: module load, venv activation
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH options, e.g. "--exclusive"
    max_restarts: int = 3  # torchrun restarts of failed workers within one allocation
    signal_before_s: int = 120  # pre-timeout warning: enough to finish a step and save a checkpoint
    rdzv_port: int = 29500  # the c10d rendezvous port on the first node (+ job id % 1000)
    # fault tolerance (meshformer/launcher/slurm_replicas.py): N groups of nodes/N nodes; 0: one job of every node
    replica_groups: int = 0
    lighthouse_port: int = 28500  # the Lighthouse's port on the first node (+ job id % 1000)

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node if self.nproc_per_node is not None else max(1, self.gpus_per_node)

    @functools.cached_property
    def cfg(self) -> Config:
        """The run's config, loaded once on first use: a config error stops the submission, not the queued job."""
        return load_config(self.config, self.all_overrides)

    @property
    def all_overrides(self) -> list[str]:
        """The job's overrides and those --replica-groups implies."""
        return [*self.overrides, *(replica_overrides(self.replica_groups) if self.replica_groups else [])]

    @property
    def nodes_per_group(self) -> int:
        """Nodes of one torchrun job: a replica group's, or the whole allocation's."""
        return self.nodes // self.replica_groups if self.replica_groups else self.nodes


def run_dir_of(job: SlurmJob) -> Path:
    return Path(job.cfg.logging.run_dir).resolve()


def check_job(job: SlurmJob) -> None:
    """Options in range and a parallel layout that fits nodes x ranks per node: refused now, not after the queue."""
    if job.nodes < 1 or job.gpus_per_node < 0 or job.ranks_per_node < 1:
        raise SubmitError(f"--nodes ({job.nodes}) and --nproc-per-node ({job.ranks_per_node}) must be >= 1 and "
                          f"--gpus-per-node ({job.gpus_per_node}) >= 0", "fix those options")
    if job.gpus_per_node and job.ranks_per_node > job.gpus_per_node:
        raise SubmitError(f"--nproc-per-node={job.ranks_per_node} ranks would share --gpus-per-node="
                          f"{job.gpus_per_node} GPUs", "use one rank per GPU: leave --nproc-per-node out")
    if job.max_restarts < 0 or job.signal_before_s < 0 or (job.cpus_per_task is not None and job.cpus_per_task < 1):
        raise SubmitError(f"--max-restarts={job.max_restarts}, --signal-before={job.signal_before_s}, --cpus-per-task="
                          f"{job.cpus_per_task}: out of range", "use --max-restarts >= 0, --signal-before >= 0 "
                          "seconds (e.g. 120) and --cpus-per-task >= 1")
    check_world_size(job.nodes * job.ranks_per_node, "--nodes x --nproc-per-node")
    if job.replica_groups:
        check_replica_split(job.replica_groups, job.nodes, job.cfg.fault_tolerance.lighthouse)
    _check_header_values(job)
    # the layout is each torchrun job's: a replica group's nodes, when there are groups
    validate_parallel(job.cfg, job.nodes_per_group * job.ranks_per_node, "cuda" if job.gpus_per_node else "cpu",
                      on_this_host=False)


def _check_header_values(job: SlurmJob) -> None:
    """What goes into an #SBATCH line verbatim: sbatch's syntax for --time and --mem, one word for the names,
    so that no value can end the line and inject a command into the script."""
    if job.time is not None and not _TIME.fullmatch(job.time):
        raise SubmitError(f"--time {job.time!r} is not a SLURM time limit",
                          "write minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS, e.g. --time 04:00:00")
    if job.mem is not None and not _MEM.fullmatch(job.mem):
        raise SubmitError(f"--mem {job.mem!r} is not a SLURM memory size",
                          "write a whole number of megabytes or one with a K, M, G or T suffix, e.g. --mem 200G")
    for option, value in (("--partition", job.partition), ("--account", job.account), ("--qos", job.qos),
                          ("--job-name", job.job_name), ("logging.run_dir", str(run_dir_of(job))),
                          ("the current folder", str(Path.cwd()))):
        if value is not None and (not value or _HEADER_UNSAFE.search(value)):
            raise SubmitError(f"{option} {value!r} is empty or holds a space, quote, newline or shell character, "
                              "which an #SBATCH line cannot carry", f"choose a {option} without them")
    for extra in job.sbatch_args:
        if not extra.startswith("-") or "\n" in extra or "\r" in extra:
            raise SubmitError(f"--sbatch-arg {extra!r} is not one sbatch option",
                              "pass one option per --sbatch-arg on one line, e.g. --sbatch-arg=--exclusive")


def sbatch_script(job: SlurmJob) -> str:
    """The batch script for `job` (nothing is written or submitted)."""
    check_job(job)
    run_dir = run_dir_of(job)
    # A file by its absolute path (on the cluster's shared filesystem, like the run folder); a bundled config by its
    # name, which meshformer resolves on the nodes: this machine's package folder need not exist there.
    config = str(Path(job.config).resolve()) if Path(job.config).is_file() else job.config
    overrides = [*job.all_overrides, f"logging.run_dir={run_dir}"]
    if job.replica_groups:  # the restart loop restarts a failed group whole, so torchrun restarts nothing
        command = torchrun_command(config, overrides, nproc_per_node=job.ranks_per_node, nnodes=job.nodes_per_group,
                                   rdzv_endpoint=_RDZV_ENDPOINT, rdzv_id=_RDZV_ID)
        torchrun = _shell_lines(command).replace(_RDZV_ENDPOINT, GROUP_RDZV_ENDPOINT).replace(_RDZV_ID, GROUP_RDZV_ID)
        lighthouse = _shell_lines([*SAFE_PYTHON, "-m", "meshformer", "lighthouse", config, "--set", *overrides,
                                   "--bind", LIGHTHOUSE_BIND])
        launch = replica_groups_launch(job.replica_groups, job.nodes_per_group, job.max_restarts, torchrun,
                                       lighthouse, job.lighthouse_port)
    else:
        command = torchrun_command(config, overrides, nproc_per_node=job.ranks_per_node, nnodes=job.nodes,
                                   rdzv_endpoint=_RDZV_ENDPOINT, rdzv_id=_RDZV_ID, max_restarts=job.max_restarts)
        torchrun = _shell_lines(command)
        torchrun = torchrun.replace(_RDZV_ENDPOINT, '"$HEAD_ADDR:$RDZV_PORT"').replace(_RDZV_ID, '"$SLURM_JOB_ID"')
        launch = f"""srun --kill-on-bad-exit=1 --ntasks-per-node=1 --output="$JOB_DIR/node%n.log" --open-mode=append \\
    {torchrun} &
SRUN_PID=$!
while true; do  # a trapped signal interrupts `wait`: wait again until srun has really ended
  wait "$SRUN_PID"; STATUS=$?
  kill -0 "$SRUN_PID" 2>/dev/null || break
done
"""
    name = job.job_name or run_dir.name
    options = [f"--job-name={name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    options += [f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []
    for flag, value in (("partition", job.partition), ("time", job.time), ("account", job.account),
                        ("qos", job.qos), ("cpus-per-task", job.cpus_per_task), ("mem", job.mem)):
        if value is not None:
            options.append(f"--{flag}={value}")
    options += [f"--output={run_dir}/slurm/job-%j.out", "--open-mode=append", "--requeue",
                f"--signal=B:USR1@{job.signal_before_s}", f"--chdir={Path.cwd()}"]
    options += ["--no-kill"] if job.replica_groups else []  # a failed node ends its group, not the allocation
    options += job.sbatch_args
    header = "\n".join(f"#SBATCH {option}" for option in options)
    setup = "\n".join(job.setup) if job.setup else "# (no --setup lines: the submitting shell's environment is used)"
    shutdown_s = job_stop_grace_s(job)
    layout = (f"# {job.replica_groups} replica groups of {job.nodes_per_group} node(s), each its own torchrun job."
              if job.replica_groups else "# Every node is one torchrun job.")
    return f"""#!/bin/bash
# Written by `meshformer submit` on {datetime.datetime.now().isoformat(timespec="seconds")} for {config}
{header}

# One srun task per node runs torchrun; torchrun starts {job.ranks_per_node} rank(s) on its node.
{layout}
set -uo pipefail
RUN_DIR={shlex.quote(str(run_dir))}
JOB_DIR="$RUN_DIR/slurm/job-$SLURM_JOB_ID"
mkdir -p "$JOB_DIR"
echo "[$(date -Is)] job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST; node logs: $JOB_DIR"

{setup}
THREADS=$(( ${{SLURM_CPUS_ON_NODE:-1}} / {job.ranks_per_node} ))  # the node's CPUs shared by its ranks
export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}}"
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # torch 2.13: elastic restarts fail without it (pytorch#135712)
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_s}  # a stop signal to SIGKILL: time for the ranks to save
export PET_SIGNALS_TO_HANDLE={AGENT_SIGNAL_NAMES}  # torchrun's --signals-to-handle: forwarded to the ranks
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# The c10d rendezvous is hosted on the first node of the allocation.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
HEAD_ADDR=${{HEAD_ADDR:-$HEAD_NODE}}
RDZV_PORT=$(( {job.rdzv_port} + SLURM_JOB_ID % 1000 ))

REQUEUE=0
on_time_limit() {{  # --signal=B:USR1: the time limit is near
  REQUEUE=1
  echo "[$(date -Is)] time limit near: the ranks checkpoint at the end of this step and stop; then requeue"
  scancel --signal=TERM "$SLURM_JOB_ID"  # the job steps (torchrun and its ranks), not this script
}}
trap on_time_limit USR1
trap 'echo "[$(date -Is)] SIGTERM (preemption or scancel): the ranks checkpoint and stop"' TERM

{launch}echo "[$(date -Is)] training exited with status $STATUS"
# Preempted (SLURM signalled the job steps for a higher-priority job): the ranks saved and stopped; requeue the job,
# as a scheduler that sees it end by itself within the grace time may not. A cancelled job (scancel) is not requeued.
PREEMPT_TIME=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/.*PreemptTime=\\([^ ]*\\).*/\\1/p')
if [ "$STATUS" != 0 ] && [ -n "$PREEMPT_TIME" ] && [ "$PREEMPT_TIME" != None ]; then
  echo "[$(date -Is)] preempted at $PREEMPT_TIME"
  REQUEUE=1
fi
if [ "$REQUEUE" = 1 ]; then
  echo "[$(date -Is)] requeueing job $SLURM_JOB_ID: it resumes from the newest checkpoint in $RUN_DIR"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$STATUS"
"""


def _shell_lines(command: list[str]) -> str:
    """Quoted command, one option per line."""
    lines: list[list[str]] = [[]]
    for arg in command:
        if arg.startswith("-") and lines[-1] and lines[-1][-1] != "-m":
            lines.append([])
        lines[-1].append(shlex.quote(arg))
    return " \\\n    ".join(" ".join(line) for line in lines)


def check_partition(partition: str) -> None:
    """Fail early, with the list to choose from, when the cluster has no such partition."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return  # sinfo unavailable: sbatch itself will judge the partition
    available = [p.strip() for p in out.stdout.split()]
    names = [p.rstrip("*") for p in available]
    if partition not in names:
        raise SubmitError(f"partition {partition!r} does not exist on this cluster; available: "
                          f"{', '.join(available) or 'none'} (* = default). Pass one with --partition, or leave "
                          "--partition out for the default")


def job_stop_grace_s(job: SlurmJob) -> int:
    """Seconds torchrun gives its ranks to save after a stop signal (checkpoint.stop_grace_s or sized to it)."""
    from meshformer.model.flops import count_params

    return stop_grace_s(job.cfg.checkpoint.stop_grace_s, count_params(job.cfg.model)["total"], job.nodes_per_group)


def warnings_for(job: SlurmJob) -> list[str]:
    """Settings that make a requeued or restarted job lose work (the job is still submitted)."""
    cfg = job.cfg
    grace = job_stop_grace_s(job)
    if job.signal_before_s < grace:
        return [f"--signal-before={job.signal_before_s} s is shorter than the {grace} s the ranks are given to save "
                "after a stop signal (checkpoint.stop_grace_s): the time limit may kill them mid-save, losing the "
                f"steps since the last checkpoint; use --signal-before {grace + 30} or more"]
    if cfg.checkpoint.interval <= 0:
        return ["checkpoint.interval=0: a requeued or restarted job starts again from step 0 and a SIGTERM "
                "saves nothing; set e.g. --set checkpoint.interval=500"]
    if not cfg.checkpoint.save_on_sigterm or not cfg.checkpoint.resume:
        return ["checkpoint.save_on_sigterm or checkpoint.resume is false: preemption and the time limit lose the "
                "steps since the last checkpoint, or a requeued job starts over; set both to true"]
    return []


def submit(job: SlurmJob, *, dry_run: bool = False) -> tuple[str, str | None]:
    """Write the script under <run_dir>/slurm/ and sbatch it: (script text, job id; None for a dry run)."""
    script = sbatch_script(job)
    if dry_run:
        return script, None
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found on PATH: run `meshformer submit` on a SLURM login node (or install "
                          "slurm-client); --dry-run prints the script without submitting it")
    if job.partition:
        check_partition(job.partition)
    logs = run_dir_of(job) / "slurm"
    try:
        logs.mkdir(parents=True, exist_ok=True)
        path = logs / f"submit-{datetime.datetime.now():%Y%m%d-%H%M%S}.sbatch"
        path.write_text(script)
    except OSError as err:
        raise SubmitError(f"cannot write the job's log folder {logs} ({err}); set logging.run_dir to a folder "
                          "on a shared filesystem you can write") from None
    result = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SubmitError(f"sbatch refused the job: {result.stderr.strip() or result.stdout.strip()} "
                          f"(script: {path})")
    job_id = result.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: script {path}, logs {logs}/job-{job_id}.out and {logs}/job-{job_id}/",
          file=sys.stderr)
    return script, job_id
