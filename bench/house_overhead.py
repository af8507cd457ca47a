"""The default run's step time in this tree against a reference revision of the project (by default 9abc769, the
tree before the loss object and the optimizer registry): whether the structure costs the default run anything.

The reference revision is checked out into a temporary detached `git worktree` under the system's temporary folder
and removed afterwards. Each measurement is a fresh process with its own PYTHONPATH (the tree measured first on the
import path), one thread, training the bundled default config (`meshformer train tiny-gpt`: configs/tiny-gpt.toml)
without evaluation, sampling or checkpoints: `Trainer.fit` over --steps steps after a --warmup-step warm-up, setup
excluded. Repeats alternate the order of the two trees, so machine noise hits both alike. Reported: each tree's
median CPU time per step (this process's, one thread: comparable on a shared machine) and wall time per step, and
this tree's over the reference's.

    OMP_NUM_THREADS=1 python bench/house_overhead.py [--reference 9abc769] [--steps 40] [--repeats 6] \
        [--table docs/benchmarks/data/training-05-house-overhead.json --machine "..."]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tables import add_table_arguments, write_table

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "tiny-gpt"  # what `meshformer train` is shown running by default (README)

# Runs in a fresh process with the measured tree first on PYTHONPATH; only APIs both trees share.
CHILD = r"""
import json, sys, tempfile, time
import torch
torch.set_num_threads(1)
import meshformer
from meshformer.config import load_config
from meshformer.train.trainer import Trainer

config, warmup, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
overrides = ["train.eval_interval=0", "train.sample_interval=0", "checkpoint.interval=0", "checkpoint.resume=false",
             "logging.tensorboard=false", f"logging.run_dir={tempfile.mkdtemp(prefix='bench-house-')}"]
cfg = load_config(config, overrides)
trainer = Trainer(cfg)
for _ in range(warmup):
    trainer.train_step()
trainer.save_final_weights = lambda **_: True  # the loop, not the final file write
cfg.train.steps = trainer.step + steps
cpu, wall = time.process_time(), time.perf_counter()
trainer.fit()
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
if trainer.step != cfg.train.steps:
    raise SystemExit(f"the trainer ran to step {trainer.step}, not {cfg.train.steps}: the timing is void")
print(json.dumps({"package": meshformer.__file__, "cpu_ms": 1e3 * cpu / steps, "wall_ms": 1e3 * wall / steps}))
"""


def measure(tree: Path, warmup: int, steps: int) -> dict[str, float]:
    """One fresh process training the default config from `tree`: ms per step (CPU and wall)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="bench-house-cwd-") as cwd:  # no tree gets a runs/ folder
        done = subprocess.run([sys.executable, "-c", CHILD, CONFIG, str(warmup), str(steps)], env=env, cwd=cwd,
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the run from {tree} failed:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    if not record.pop("package").startswith(str(tree)):
        raise SystemExit(f"the run meant for {tree} imported another meshformer")
    return record


def reference_tree(revision: str, folder: Path) -> Path:
    """`revision` checked out (detached) into `folder`."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision], check=True,
                   capture_output=True, text=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default="9abc769", help="the git revision to compare against")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed ones")
    parser.add_argument("--repeats", type=int, default=6, help="runs per tree, alternating which goes first")
    add_table_arguments(parser)
    args = parser.parse_args()
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.reference], check=True,
                              capture_output=True, text=True).stdout.strip()
    ours_revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                                   capture_output=True, text=True).stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix="bench-house-ref-")) / "tree"
    runs: dict[str, list[dict[str, float]]] = {"reference": [], "ours": []}
    try:
        trees = {"reference": reference_tree(revision, folder), "ours": ROOT}
        for repeat in range(args.repeats):
            order = ["reference", "ours"] if repeat % 2 == 0 else ["ours", "reference"]
            for name in order:
                runs[name].append(measure(trees[name], args.warmup, args.steps))
                print(json.dumps({"repeat": repeat, "tree": name, **runs[name][-1]}), file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)], capture_output=True)
    medians = {name: {clock: statistics.median(r[clock] for r in records) for clock in ("cpu_ms", "wall_ms")}
               for name, records in runs.items()}
    ratio = {clock: medians["ours"][clock] / medians["reference"][clock] for clock in ("cpu_ms", "wall_ms")}
    print(json.dumps({"bench": "house_overhead", "config": CONFIG, "reference": revision, "ours": ours_revision,
                      "steps": args.steps, "repeats": args.repeats, "medians": medians,
                      "ratio_cpu": round(ratio["cpu_ms"], 4), "ratio_wall": round(ratio["wall_ms"], 4)}), flush=True)
    if args.table:
        write_overhead_table(args, medians, {"reference": revision, "ours": ours_revision})


def write_overhead_table(args: argparse.Namespace, medians: dict[str, dict[str, float]],
                         revisions: dict[str, str]) -> None:
    """docs/benchmarks/data/training-05-house-overhead.json: each tree's median ms per step and its ratio to the
    reference's."""
    rows = []
    for name, label in (("reference", "reference"), ("ours", "this tree")):
        cpu, wall = medians[name]["cpu_ms"], medians[name]["wall_ms"]
        rows.append([f"{label} ({revisions[name]})", f"{cpu:.1f}", f"{wall:.1f}",
                     f"{cpu / medians['reference']['cpu_ms']:.3f}", f"{wall / medians['reference']['wall_ms']:.3f}"])
    write_table(args.table, machine=args.machine, page="training",
                title="The default run: this tree against the tree before the loss object and optimizer registry",
                command=f"OMP_NUM_THREADS=1 python bench/house_overhead.py --reference {args.reference} "
                        f"--steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}",
                setup=f"`meshformer train {CONFIG}`'s config (fp32, one thread, no evaluation, sampling or "
                      f"checkpoints), `Trainer.fit` over {args.steps} steps after {args.warmup}; each tree in fresh "
                      f"processes, {args.repeats} runs each, alternating which goes first; medians. CPU time is the "
                      "process's: on a shared machine it counts the work alone, where wall time also counts waits "
                      "for the cores.",
                columns=["tree", "CPU ms / step", "wall ms / step", "CPU ratio", "wall ratio"], rows=rows,
                align="lrrrr")

if __name__ == "__main__":
    main()
