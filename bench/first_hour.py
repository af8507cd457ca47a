"""A newcomer's first hour, timed: from an empty folder and a fresh virtual environment to the first loss line, to a
trained tiny model exported to Hugging Face and generating, and to a continued-pretraining run from that folder.

Every command is one the documentation shows (tests/unit/bench/test_first_hour_bench.py checks that), run from a
wheel of this checkout in an empty folder. The package index is whatever pip is configured with (on a fresh machine: the
internet; the time to install depends on it and is reported apart).

    python bench/first_hour.py                                     # print the milestones as JSON
    python bench/first_hour.py --table docs/benchmarks/data/training-03-first-hour.json --machine "..."
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import add_table_arguments, write_table

ROOT = Path(__file__).resolve().parents[1]

# `{wheel}` is the wheel's path; then (milestone, the command as the docs show it).
INSTALL = "pip install torch==2.13.0 '{wheel}[hf]'"
JOURNEY: list[tuple[str, str]] = [
    ("trained 100 steps (the docs' shortened quick start)", "meshformer train tiny-gpt --set train.steps=100"),
    ("checkpoint to safetensors", "meshformer convert to-safetensors runs/tiny-gpt/checkpoints runs/tiny-gpt/export"),
    ("exported to Hugging Face", "meshformer convert export-hf runs/tiny-gpt/export hf/tiny-gpt --arch gpt2"),
    ("generated text", 'meshformer generate runs/tiny-gpt/final --prompt "And God said" --prompt "In the beginning"'),
    ("continued pretraining from the Hugging Face folder (50 steps)",
     "meshformer train tiny-gpt --init-from hf/tiny-gpt --new-run --set train.steps=50 optim.lr=1e-4"),
]


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True)
    return next(out.glob("meshformer-*.whl"))


def timed(command: str, cwd: Path, env: dict[str, str]) -> tuple[float, float | None, str]:
    """(seconds to finish, seconds to the first progress line or None, the output's last lines)."""
    start = time.monotonic()
    first: float | None = None
    lines: list[str] = []
    with subprocess.Popen(command, shell=True, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if first is None and "] step " in line and "| loss" in line:
                first = time.monotonic() - start
        code = proc.wait()
    if code:
        raise SystemExit(f"`{command}` exited {code}:\n{''.join(lines[-40:])}")
    return time.monotonic() - start, first, "".join(lines[-3:])


def run(workdir: Path, wheel: Path | None) -> list[dict]:
    wheel = wheel or build_wheel(workdir / "dist")
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["MESHFORMER_CACHE"] = str(workdir / "cache")
    folder = workdir / "empty"
    folder.mkdir()
    steps = []
    install = INSTALL.format(wheel=wheel)
    seconds, _, _ = timed(install, folder, env)
    steps.append({"milestone": "installed (fresh venv)", "command": install.replace(str(wheel), "meshformer-*.whl"),
                  "seconds": seconds, "first_loss_s": None})
    for milestone, command in JOURNEY:
        seconds, first, _ = timed(command, folder, env)
        steps.append({"milestone": milestone, "command": command, "seconds": seconds, "first_loss_s": first})
    return steps


def table_rows(steps: list[dict]) -> list[list[str]]:
    """One row per milestone: its command, how long it took, and the clock at its first loss line and at its end."""
    rows, total = [], 0.0
    for step in steps:
        first = f"{total + step['first_loss_s']:.0f} s" if step["first_loss_s"] is not None else ""
        total += step["seconds"]
        rows.append([step["milestone"], f"`{step['command']}`", f"{step['seconds']:.0f} s", first, f"{total:.0f} s"])
    return rows


def write(path: Path, steps: list[dict], machine: str) -> dict:
    return write_table(path, machine=machine, page="training", title="The first hour, from a wheel in an empty folder",
                       command="python bench/first_hour.py --table ...",
                       setup="Each command as the docs show it, one after the other, in an empty folder with a fresh "
                             "venv; the clock runs from the start of the install.",
                       columns=["milestone", "command", "took", "first loss line at", "done at"],
                       align=["l", "l", "r", "r", "r"], rows=table_rows(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a built wheel (default: build one from this checkout)")
    add_table_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-hour-") as tmp:
        steps = run(Path(tmp), args.wheel and args.wheel.resolve())
    print(json.dumps(steps, indent=1))
    if args.table:
        write(args.table, steps, args.machine)


if __name__ == "__main__":
    main()
