"""Peak memory of a pipeline step with the plain and the chunked head loss, side by side in one launch (CPU/gloo).

The last stage holds the output projection; with train.loss=plain it keeps each micro-batch's B·T·V logits
and their fp32 softmax for backward, with the chunked loss one chunk of logits. Peak = live tensor bytes of
one training step (meshformer.plan.measure), the worst pipeline rank and the last stage's rank; prints one
JSON line per schedule with the chunked / plain ratios.

    python bench/pp_head_loss_memory.py [--vocab 32000] [--schedules 1f1b gpipe zbv]
"""

from __future__ import annotations

import argparse
import json

from parallel_common import spawn

from meshformer.plan.validation import validation_config

GiB = 2**30


def measure(schedules: list[str], vocab: int) -> dict[str, dict[str, int]]:
    """This rank's peak (bytes) per schedule and loss."""
    from meshformer.plan.measure import measure_step_peak

    out: dict[str, dict[str, int]] = {}
    for schedule in schedules:
        for loss in ("plain", "chunked"):
            cfg = validation_config({"pp": 2, "pp_schedule": schedule, "pp_microbatches": 4}, vocab=vocab)
            cfg.train.loss = loss
            out.setdefault(schedule, {})[loss] = measure_step_peak(cfg)["peak"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zbv"])
    args = parser.parse_args()
    per_rank = spawn(2, measure, args.schedules, args.vocab)
    for schedule in args.schedules:
        last = 0 if schedule == "zbv" else 1  # ZBV's V places the last stage on rank 0
        peaks = {loss: [rank[schedule][loss] for rank in per_rank] for loss in ("plain", "chunked")}
        print(json.dumps({
            "bench": "pp_head_loss_memory", "schedule": schedule, "vocab": args.vocab,
            "last_stage_mib": {loss: round(p[last] / 2**20, 2) for loss, p in peaks.items()},
            "last_stage_ratio": round(peaks["chunked"][last] / peaks["plain"][last], 3),
            "worst_rank_ratio": round(max(peaks["chunked"]) / max(peaks["plain"]), 3),
        }))


if __name__ == "__main__":
    main()
