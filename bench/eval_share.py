"""The share of a training run's time that in-loop downstream evaluation takes at the default interval.

The bundled default run (`tiny-gpt`: 300 steps, held-out evaluation every 100) trains with `downstream.tasks` set
and every other downstream option at its default: the tasks are scored through lm-eval's evaluator every
`train.eval_interval` steps and at the last one, with data.batch_size requests per forward. The share is the
downstream scoring's seconds (the sum of the logged `downstream/time_s`) over the wall time of `Trainer.fit`, both
from the same run; the data is prepared before the clock starts.

    python bench/eval_share.py [--threads 2] [--steps 300] [--sets multiple-choice,every-type]
        [--table docs/benchmarks/data/training-05-eval-share.json --machine "..."]

One JSON line per task set: {"bench": "eval_share", "tasks", "evaluations", "fit_s", "downstream_s", "share"}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tables import add_table_arguments, write_table  # noqa: E402

TASK_SETS = {  # --sets name: (table label, downstream.tasks)
    "multiple-choice": ("multiple choice (kjv_cloze, kjv_next)", ["bundled:kjv_cloze", "bundled:kjv_next"]),
    "every-type": ("every output type (the five bundled tasks)",
                   ["bundled:kjv_cloze", "bundled:kjv_next", "bundled:kjv_lastword", "bundled:kjv_perplexity",
                    "bundled:kjv_complete"]),
}
COLUMNS = ["downstream.tasks", "evaluations", "training run (s)", "downstream scoring (s)", "share of the run"]


def measure(name: str, tasks: list[str], steps: int, work: Path) -> dict[str, Any]:
    from meshformer.config import load_config
    from meshformer.train.preflight import preflight
    from meshformer.train.trainer import Trainer

    listed = ", ".join(f'"{task}"' for task in tasks)
    run_dir = work / f"run-{len(tasks)}"
    cfg = load_config("tiny-gpt", [f"downstream.tasks=[{listed}]", f"train.steps={steps}",
                                   f'logging.run_dir="{run_dir}"', "logging.tensorboard=false"])
    tokenizer = preflight(cfg)  # the data is prepared here, outside the timed run
    start = time.perf_counter()
    result = Trainer(cfg, tokenizer=tokenizer).fit()
    fit_s = time.perf_counter() - start
    if result.stopped_by is not None:
        raise SystemExit(f"the {name} run was stopped by a signal: no figures")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [line["downstream/time_s"] for line in lines if "downstream/time_s" in line]
    record = {"bench": "eval_share", "tasks": name, "evaluations": len(scored), "fit_s": fit_s,
              "downstream_s": sum(scored), "share": sum(scored) / fit_s}
    print(json.dumps(record), flush=True)
    return record


def table_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r["tasks"], r["evaluations"], f"{r['fit_s']:.0f}", f"{r['downstream_s']:.1f}",
             f"{100 * r['share']:.1f}%"] for r in records]


def write(args: argparse.Namespace, records: list[dict[str, Any]]) -> None:
    write_table(args.table, machine=args.machine, page="training", title="In-loop evaluation's share of a training run",
                command=f"python bench/eval_share.py --threads {args.threads} --steps {args.steps} --sets {args.sets}",
                columns=COLUMNS, rows=table_rows(records),
                setup=f"tiny-gpt ({args.steps} steps, train.eval_interval 100, fp32 on the CPU, {args.threads} "
                "threads) with downstream.tasks set and the other downstream options at their defaults (every "
                "train.eval_interval steps and at the last step, data.batch_size requests per forward, every "
                "document)",
                notes="share: the logged downstream/time_s summed over the run, over the wall time of the training "
                "run (Trainer.fit) it is part of")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="train.steps (tiny-gpt's own: 300; a multiple of its "
                        "eval_interval, 100, keeps the share: each interval trains 100 steps and scores once)")
    parser.add_argument("--sets", default=",".join(TASK_SETS), help=f"task sets, of {', '.join(TASK_SETS)}")
    add_table_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="eval_share_"))
    records = [measure(*TASK_SETS[name], args.steps, work) for name in args.sets.split(",")]
    if args.table:
        write(args, records)


if __name__ == "__main__":
    main()
