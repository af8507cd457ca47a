"""Where a killed replica group's return goes: a timeline of one kill -9 in a real `meshformer train --replica-groups`
run, from the kill to the killed group's first committed step in the quorum again.

    python bench/fault_tolerance_rejoin.py [--config tiny-gpt] [--groups 2] [--ranks 1] [--kill-at 5] [--code DIR]

Every process of the run starts with bench/ft_trace/ on PYTHONPATH, whose sitecustomize prints timestamps (process
creation, the interpreter up, the imports of torch, torchft and the trainer, the trainer's set-up, process-group
creation, the group's first quorum, a heal); the launcher's and the ranks' own lines are stamped as they arrive.
The last rank of group 1 is killed after `--kill-at` steps of both groups. Prints the timeline relative to the
kill, then one JSON line of the phases (seconds): `--code DIR` runs another checkout's meshformer (the same
settings as bench/fault_tolerance.py's rows: heartbeat timeout 1 s, join timeout 10 s, no checkpoints), so two
versions compare back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from fault_tolerance import COMMON, FT, LONG, _kill, _records, _stop, _wait

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(__file__).resolve().parent / "ft_trace"


class Stamped:
    """The run's output, each line with the time it arrived (TRACE lines carry their own time)."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.log = log.open("w")
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            now = time.time()
            if line.startswith("TRACE "):
                now = float(line.split()[1])
            self.lines.append((now, line))
            self.log.write(f"{now:.3f} {line}\n")
            self.log.flush()


def _first(lines: list[tuple[float, str]], after: float, *needles: str) -> float | None:
    for at, line in sorted(lines):
        if at > after and all(n in line for n in needles):
            return at
    return None


def profile(args: argparse.Namespace, folder: Path) -> dict[str, float | None]:
    run_dir = folder / "run"
    code = str(Path(args.code).resolve()) if args.code else str(ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TRACE), code])}
    cmd = [sys.executable, "-m", "meshformer", "train", args.config, "--replica-groups", str(args.groups),
           "--nproc-per-node", str(args.ranks), "--set", *COMMON, "train.device=cpu", f"train.steps={LONG}",
           f"logging.run_dir={run_dir}", f"parallel.dp_shard={args.ranks}", *FT, "checkpoint.interval=0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=folder)
    out = Stamped(proc, folder / "run.log")
    try:
        _wait(lambda: all(len(_records(run_dir, r)) >= args.kill_at for r in range(args.groups)), 1200,
              f"the groups to train {args.kill_at} steps", proc)
        killed = _kill(proc.pid, args.ranks - 1, replica=1)
        _wait(lambda: any(r["time"] > killed for r in _records(run_dir, 1)), 600, "the killed group's return", proc)
        time.sleep(1.0)
    finally:
        _stop(proc)
        out.thread.join(timeout=5)
    lines = out.lines
    survivor = [r for r in _records(run_dir, 0) if r["time"] > killed]
    before = [r["time"] for r in _records(run_dir, 0) if r["time"] <= killed]
    step_s = (before[-1] - before[-4]) / 3 if len(before) >= 4 else float("nan")
    back = min(r["time"] for r in _records(run_dir, 1) if r["time"] > killed)
    # the process that trains as the killed group's last rank after the kill: a new interpreter, or a warm rank whose
    # creation and imports came before the kill (negative times below)
    started = _first(lines, killed, "rank1 Trainer.__init__ start")
    pid = next((line.split()[2] for at, line in lines if at == started and line.startswith("TRACE ")), "?")
    rank = f"{pid} rank1 "
    events = {
        "launcher notices the exit": _first(lines, killed, "replica group 1 exited with status"),
        "rank process created": _first(lines, 0.0, rank + "process created"),
        "rank: interpreter up": _first(lines, 0.0, rank + "interpreter up"),
        "rank: torch imported": _first(lines, 0.0, rank + "import torch end"),
        "rank: trainer module imported": _first(lines, 0.0, rank + "import meshformer.train.trainer end"),
        "rank: Trainer set-up starts": started,
        "rank: process group created": _first(lines, killed, rank + "init_process_group end"),
        "rank: Trainer set-up done": _first(lines, killed, rank + "Trainer.__init__ end"),
        "rank: restore_state (checkpoint) done": _first(lines, killed, rank + "restore_state end"),
        "rank: torchft imported": _first(lines, 0.0, rank + "import torchft end"),
        "rank: ReplicaGroup made": _first(lines, killed, rank + "ReplicaGroup.__init__ end"),
        "rank: heal starts": _first(lines, killed, rank + "load_live_state start"),
        "rank: heal done": _first(lines, killed, rank + "load_live_state end"),
        "rank: first quorum (with the heal)": _first(lines, killed, rank + "ReplicaGroup.start_step_or_wait end"),
        "killed group's first step committed": back,
        "survivors' next step committed": survivor[0]["time"] if survivor else None,
        "survivors' first step with the group back": next(
            (r["time"] for r in survivor if 1 in r["replicas"]), None),
    }
    print(f"kill -9 of group 1 at {killed:.3f}; the survivors' step before it: {step_s:.3f}s")
    for name, at in sorted(events.items(), key=lambda item: item[1] or float("inf")):
        print(f"  {'-' if at is None else f'{at - killed:7.2f}s'}  {name}")
    result: dict[str, float | None] = {name: (None if at is None else round(at - killed, 3))
                                       for name, at in events.items()}
    result["step_s"] = round(step_s, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-gpt")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--code", help="a meshformer checkout to run instead of this one (its repository root)")
    parser.add_argument("--keep", help="a folder to keep the run's log in (else a temporary one)")
    args = parser.parse_args()
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        result = profile(args, Path(args.keep))
    else:
        with tempfile.TemporaryDirectory(prefix="ft-rejoin-") as folder:
            result = profile(args, Path(folder))
    print(json.dumps({"code": args.code or str(ROOT), **result}))


if __name__ == "__main__":
    main()
