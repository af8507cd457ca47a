"""`meshformer data submit-prepare INPUTS --out DIR --parts N`: a prepare as SLURM array jobs.

Three jobs, chained with `--dependency=afterok`: the map stage as an array of N tasks, the reduce stage as an
array of N tasks, and one merge task. Each task runs `meshformer data prepare ... --part slurm --stage S`,
which reads its slice from SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT. The output does not depend on N
(see prepare.py), so N only sets how many machines share the work. The work folder (<out>.work) and the
output must be on a filesystem every node sees. Logs: <out>.slurm/.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from meshformer.errors import SubmitError, UsageError


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
    command = [sys.executable, "-m", "meshformer.cli", "data", "prepare", *prepare_args, "--stage", stage, *part,
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
