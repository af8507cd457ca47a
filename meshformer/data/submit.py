"""`meshformer data submit-prepare`: a prepare as three chained SLURM array jobs (map, reduce, merge)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from meshformer.errors import SubmitError, UsageError

SUBMIT_PREPARE_DESCRIPTION = """\
Run `meshformer data prepare` as SLURM array jobs: the map stage as an array of --parts tasks, then the reduce
stage as another, then one merge task, each starting when the one before has succeeded. The output does not
depend on --parts, which only sets how many machines share the work. The output folder and its work folder
(<out>.work) must be on a filesystem every node sees. Job logs: <out>.slurm/.

example:
  meshformer data submit-prepare corpus/ --out data/big --tokenizer tok.json --parts 16 --sbatch=--partition=cpu
"""


def part_from_env() -> tuple[int, int]:
    """(task id, task count) of the SLURM array task this runs in."""
    try:
        return int(os.environ["SLURM_ARRAY_TASK_ID"]), int(os.environ["SLURM_ARRAY_TASK_COUNT"])
    except (KeyError, ValueError):
        raise UsageError("--part slurm needs SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT",
                         "run it as an sbatch --array task, or pass --part i/N") from None


def stage_script(prepare_args: list[str], out: str, stage: str, parts: int, options: list[str]) -> str:
    """The batch script of one stage (an array of `parts` tasks, or one merge task)."""
    logs = Path(out).resolve().with_name(Path(out).name + ".slurm")
    array = [f"--array=0-{parts - 1}"] if stage != "merge" else []
    header = [f"--job-name=prepare-{stage}", *array, "--ntasks=1", f"--output={logs}/{stage}-%A_%a.out",
              f"--chdir={Path.cwd()}", *options]
    part = ["--part", "slurm"] if stage != "merge" else ["--part", f"0/{parts}"]
    # -P: a module in the job's folder (--chdir) does not shadow meshformer's own imports
    command = [sys.executable, "-P", "-m", "meshformer.cli", "data", "prepare", *prepare_args, "--stage", stage, *part,
               "--quiet"]
    lines = "\n".join(f"#SBATCH {o}" for o in header)
    return f"#!/bin/bash\n{lines}\nset -euo pipefail\nexport PYTHONUNBUFFERED=1\n{shlex.join(command)}\n"


def submit_prepare(prepare_args: list[str], out: str, parts: int, options: list[str],
                   dry_run: bool = False) -> list[str]:
    """sbatch map, reduce and merge; returns the job ids (or, for a dry run, the scripts)."""
    if parts < 1:
        raise SubmitError(f"--parts {parts} must be >= 1")
    scripts = [stage_script(prepare_args, out, s, parts, options) for s in ("map", "reduce", "merge")]
    if dry_run:
        return scripts
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found on PATH: run `meshformer data submit-prepare` on a SLURM login node, "
                          "or run the stages yourself with `meshformer data prepare --part i/N --stage ...`")
    logs = Path(out).resolve().with_name(Path(out).name + ".slurm")
    logs.mkdir(parents=True, exist_ok=True)
    ids: list[str] = []
    for stage, script in zip(("map", "reduce", "merge"), scripts):
        path = logs / f"{stage}.sbatch"
        path.write_text(script)
        after = [f"--dependency=afterok:{ids[-1]}", "--kill-on-invalid-dep=yes"] if ids else []
        done = subprocess.run(["sbatch", "--parsable", *after, str(path)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise SubmitError(f"sbatch refused the {stage} job: {done.stderr.strip() or done.stdout.strip()}")
        ids.append(done.stdout.strip().split(";")[0])
    return ids
