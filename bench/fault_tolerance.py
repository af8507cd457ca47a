"""Fault-tolerant replica groups (docs/fault-tolerance.md) against today's restart path, on CPU with gloo.

    python bench/fault_tolerance.py [--groups 2] [--ranks 1] [--table docs/benchmarks/data/fault-tolerance-01-cpu.json
                                     --machine "..."]

Four runs of tiny-gpt, each a real `meshformer train` command:
1. no failure, data parallel as one torchrun job: `--nproc-per-node G*R` with parallel.dp_replicate=G;
2. no failure, the same ranks as G replica groups of R (`--replica-groups G --nproc-per-node R`);
   the step-time ratio 2/1 is what fault tolerance costs when nothing fails (median of the steps after the third);
3. replica groups, one rank of group 1 killed with SIGKILL mid-run: the seconds from the kill to the survivors'
   next committed step, and to the killed group's return (its first step in the quorum again);
4. the one torchrun job of run 1 with `--max-restarts 1` and a checkpoint every `--checkpoint-every` steps, one rank
   killed the same way: the seconds from the kill to the first step beyond the one it was killed in (the restart,
   the resume and the steps trained again).
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import add_table_arguments, write_table

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["train.eval_interval=0", "train.sample_interval=0", "logging.log_interval=1", "logging.tensorboard=false",
          "data.num_workers=0", "train.device=cpu"]
FT = ["fault_tolerance.heartbeat_timeout_s=1", "fault_tolerance.join_timeout_s=2"]
COLUMNS = ["what", "replica groups", "checkpoint-restart (torchrun --max-restarts)"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _command(run_dir: Path, steps: int, *options: str, overrides: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "meshformer", "train", "tiny-gpt", *options, "--set", *COMMON,
            f"train.steps={steps}", f"logging.run_dir={run_dir}", *overrides]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [m for m in map(json.loads, lines) if "train/loss" in m]


def _records(run_dir: Path, replica: int) -> list[dict]:
    path = run_dir / f"replica-{replica}" / "replicas.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.is_file() else []


def _median_step_s(metrics: list[dict]) -> float:
    return statistics.median(m["perf/step_time_s"] for m in metrics if m["step"] > 3)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in children.read_text().split()]
        except (OSError, ValueError):
            pass
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)


def _rank(root: int, rank: int, replica: int | None = None) -> int | None:
    """The pid of `rank` (of replica group `replica`) among the descendants of `root`."""
    stack = [root]
    while stack:
        pid = stack.pop()
        env = _environ(pid)
        if env.get("RANK") == str(rank) and "LOCAL_RANK" in env and \
                (replica is None or env.get("MESHFORMER_REPLICA_ID") == str(replica)):
            return pid
        stack += _children(pid)
    return None


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def _run(cmd: list[str], log: Path, timeout: float = 1800) -> None:
    with open(log, "w") as out:
        code = subprocess.run(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code:
        raise SystemExit(f"`{' '.join(cmd)}` failed ({code}); see {log}")


def measure(folder: Path, groups: int, ranks: int, steps: int, kill_steps: int, kill_at: int,
            checkpoint_every: int) -> dict[str, float]:
    world = groups * ranks
    inside = [f"parallel.dp_shard={ranks}"]
    plain = ["parallel.dp_replicate=" + str(groups), f"parallel.dp_shard={ranks}"]
    result: dict[str, float] = {}

    _run(_command(folder / "plain", steps, "--nproc-per-node", str(world), overrides=(*plain,)), folder / "plain.log")
    result["plain_step_s"] = _median_step_s(_metrics(folder / "plain"))
    _run(_command(folder / "ft", steps, "--replica-groups", str(groups), "--nproc-per-node", str(ranks),
                  overrides=(*inside, *FT)), folder / "ft.log")
    result["ft_step_s"] = _median_step_s(_metrics(folder / "ft" / "replica-0"))

    # kill -9 of one rank of group 1: the survivors' next step, and the group's return
    run_dir = folder / "ft-kill"
    with open(folder / "ft-kill.log", "w") as out:
        proc = subprocess.Popen(_command(run_dir, kill_steps, "--replica-groups", str(groups), "--nproc-per-node",
                                         str(ranks), overrides=(*inside, *FT, "checkpoint.interval=0")),
                                env=_env(), stdout=out, stderr=subprocess.STDOUT)
        _wait(lambda: len(_records(run_dir, 1)) >= kill_at, 600, f"group 1 to train {kill_at} steps")
        victim = _rank(proc.pid, ranks - 1, replica=1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        _wait(lambda: any(r["time"] > killed for r in _records(run_dir, 0)), 600, "the survivors' next step")
        result["ft_next_step_s"] = min(r["time"] for r in _records(run_dir, 0) if r["time"] > killed) - killed
        _wait(lambda: any(r["time"] > killed for r in _records(run_dir, 1)) or proc.poll() is not None, 1200,
              "the killed group's return")
        back = [r["time"] for r in _records(run_dir, 1) if r["time"] > killed]
        result["ft_rejoin_s"] = (min(back) - killed) if back else float("nan")
        if proc.wait(timeout=1800):
            raise SystemExit(f"the replica-group run with a kill failed; see {folder / 'ft-kill.log'}")

    # the same kill under torchrun --max-restarts with periodic checkpoints
    run_dir = folder / "restart-kill"
    with open(folder / "restart-kill.log", "w") as out:
        proc = subprocess.Popen(_command(run_dir, kill_steps, "--nproc-per-node", str(world), "--max-restarts", "1",
                                         overrides=(*plain, f"checkpoint.interval={checkpoint_every}")),
                                env=_env(), stdout=out, stderr=subprocess.STDOUT)
        _wait(lambda: len(_metrics(run_dir)) >= kill_at, 600, f"the job to train {kill_at} steps")
        reached = max(m["step"] for m in _metrics(run_dir))
        victim = _rank(proc.pid, world - 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.time()
        _wait(lambda: max((m["step"] for m in _metrics(run_dir)), default=0) > reached + 1 or
              proc.poll() is not None, 1200, "the restarted job to pass the killed step")
        result["restart_next_step_s"] = time.time() - killed
        result["restart_steps_retrained"] = float(reached % checkpoint_every)
        if proc.wait(timeout=1800):
            raise SystemExit(f"the torchrun run with a kill failed; see {folder / 'restart-kill.log'}")
    return result


def table_rows(result: dict[str, float]) -> list[list[str]]:
    return [
        ["step time when nothing fails (s)",
         f"{result['ft_step_s']:.3f} ({result['ft_step_s'] / result['plain_step_s']:.2f}x)",
         f"{result['plain_step_s']:.3f} (1.00x)"],
        ["kill -9 of a rank to the survivors' next step (s)", f"{result['ft_next_step_s']:.1f}",
         f"{result['restart_next_step_s']:.1f} (to the first step past the killed one)"],
        ["kill -9 to the killed group back in the quorum (s)", f"{result['ft_rejoin_s']:.1f}",
         "(the whole job restarts)"],
        ["steps trained again", "0", f"{result['restart_steps_retrained']:.0f}"],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups (data-parallel replicas)")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per group (FSDP inside it)")
    parser.add_argument("--steps", type=int, default=20, help="steps of the runs without a failure")
    parser.add_argument("--kill-steps", type=int, default=90, help="steps of the runs with a kill")
    parser.add_argument("--kill-at", type=int, default=8, help="steps trained before the kill")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="checkpoint interval of the restart path")
    add_table_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshformer-ft-bench-") as tmp:
        result = measure(Path(tmp), args.groups, args.ranks, args.steps, args.kill_steps, args.kill_at,
                         args.checkpoint_every)
    print(json.dumps({"groups": args.groups, "ranks": args.ranks, **result}))
    if args.table:
        write(args.table, result, args, args.machine)


def write(path: Path, result: dict[str, float], args: argparse.Namespace, machine: str) -> None:
    write_table(path, machine=machine, page="fault-tolerance", title="Replica groups against checkpoint-restart",
                command=f"python bench/fault_tolerance.py --groups {args.groups} --ranks {args.ranks}",
                setup=f"tiny-gpt, {args.groups} data-parallel replicas of {args.ranks} rank"
                      + ("s (FSDP inside)" if args.ranks > 1 else "") + ", gloo; the restart path checkpoints every "
                      f"{args.checkpoint_every} steps:",
                notes="Both paths ran on the same shared cores, one after the other, so the step-time ratio carries "
                      "the machine's run-to-run spread (the groups' one flat all-reduce against HSDP's "
                      "per-parameter reductions is within it). The survivors' pause is about the Lighthouse's "
                      "heartbeat timeout (1 s here) plus a step; a killed group's return is mostly its start-up "
                      "(imports, model build), which the survivors do not wait for.",
                align=["l", "r", "r"], columns=COLUMNS, rows=table_rows(result))


if __name__ == "__main__":
    main()
