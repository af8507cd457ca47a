"""Requests per second of meshformer's lm-eval model against lm-eval's own `hf` model, per output type.

Both score the same requests of the bundled tasks (multiple choice, loglikelihood, loglikelihood_rolling,
generate_until) on one exported tiny Llama, on the CPU with the same threads and batch size; the ratio is
meshformer's requests/s over `hf`'s (above 1: meshformer is faster). Each side runs every task once to warm up,
then the two take turns `--repeats` times (a change in the machine's load hits both alike); each one's best time
counts.

    python bench/lm_eval_speed.py [--threads 2] [--limit 40] [--table docs/benchmarks/data/training-04-lm-eval.json
        --machine "..."]

One JSON line per output type: {"bench": "lm_eval_speed", "output_type", "requests", "ours_rps", "hf_rps", "ratio"}.
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
for path in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from tables import add_table_arguments, write_table  # noqa: E402

TASKS = {"multiple_choice": "bundled:kjv_cloze", "loglikelihood": "bundled:kjv_lastword",
         "loglikelihood_rolling": "bundled:kjv_perplexity", "generate_until": "bundled:kjv_complete"}
COLUMNS = ["output type", "task", "requests", "meshformer requests/s", "hf requests/s", "ratio"]


def requests_of(lm: Any, task: str, limit: int) -> tuple[str, list[Any]]:
    """(request type, lm-eval's built requests) of one task, as its evaluator builds them."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from meshformer.eval.run import template_environment
    from meshformer.eval.task_files import lm_eval_config

    with template_environment(trust=False):
        built = get_task_dict([lm_eval_config(task)], TaskManager())
        (obj,) = built.values()
        obj.build_all_requests(limit=limit, rank=0, world_size=1)
    requests = [instance for instance in obj.instances]
    return requests[0].request_type, requests


def best_seconds(lms: list[Any], kind: str, requests: list[Any], repeats: int) -> list[float]:
    """Each model's best time over `repeats` turns, the models taking turns within each."""
    for lm in lms:
        getattr(lm, kind)(requests)  # warm-up
    best = [float("inf")] * len(lms)
    for _ in range(repeats):
        for at, lm in enumerate(lms):
            start = time.perf_counter()
            getattr(lm, kind)(requests)
            best[at] = min(best[at], time.perf_counter() - start)
    return best


def measure(threads: int, limit: int, repeats: int, batch_size: int) -> list[dict[str, Any]]:
    from helpers.hf_models import hf_model
    from lm_eval.models.huggingface import HFLM

    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.data import load_tokenizer
    from meshformer.eval.lm import MeshformerLM

    torch.set_num_threads(threads)
    folder = Path(tempfile.mkdtemp(prefix="lm_eval_speed_"))
    model = from_hf_model(hf_model("llama"))
    export_hf(model.state_dict(), model.cfg, folder, tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    ours = MeshformerLM(path=str(folder), batch_size=batch_size)
    theirs = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=batch_size)
    records = []
    for output_type, task in TASKS.items():
        kind, requests = requests_of(ours, task, limit)
        ours_s, hf_s = best_seconds([ours, theirs], kind, requests, repeats)
        record = {"bench": "lm_eval_speed", "output_type": output_type, "task": task, "requests": len(requests),
                  "ours_rps": len(requests) / ours_s, "hf_rps": len(requests) / hf_s, "ratio": hf_s / ours_s}
        print(json.dumps(record), flush=True)
        records.append(record)
    return records


def table_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r["output_type"], r["task"], r["requests"], f"{r['ours_rps']:.1f}", f"{r['hf_rps']:.1f}",
             f"{r['ratio']:.2f}×"] for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=40, help="documents per task")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    add_table_arguments(parser)
    args = parser.parse_args()
    records = measure(args.threads, args.limit, args.repeats, args.batch_size)
    if args.table:
        write_table(args.table, machine=args.machine, page="training", title="lm-eval requests per second",
                    command=f"python bench/lm_eval_speed.py --threads {args.threads} --limit {args.limit}",
                    columns=COLUMNS, rows=table_rows(records),
                    setup="one exported tiny Llama (2 layers, d_model 32, vocabulary 4096), fp32 on the CPU, "
                    f"batch size {args.batch_size}; both models score the same lm-eval requests",
                    notes="ratio: meshformer's requests/s over lm-eval's `hf` model's (above 1: meshformer is "
                    "faster)")


if __name__ == "__main__":
    main()
