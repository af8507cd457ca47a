"""Peak memory of a pipeline step with the plain, the chunked and the recomputing chunked head loss, side by side
in one launch (CPU/gloo).

The last stage holds the output projection; with train.loss=plain it keeps each micro-batch's B·T·V logits
and their fp32 softmax for backward; the chunked loss keeps each micro-batch's gradients (hidden states and the
fp32 V x D weight gradient) from its forward to its backward; chunked_recompute keeps one fp32 log-partition
per row and recomputes the logits in the backward. Peak = live tensor bytes of one training step
(meshformer.planner.measure), the worst pipeline rank and the last stage's rank; prints one JSON line per
schedule with the ratios against plain and recompute / chunked.

Recomputing vs stored chunked loss, last-stage peak at V 32000 / 128000: GPipe 0.77x / 0.76x, interleaved_zb
0.87x / 0.86x, 1F1B and ZBV (one micro-batch held) 1.0x.

    python bench/pp_head_loss_memory.py [--vocab 32000] [--seq 128] [--schedules 1f1b gpipe zbv interleaved_zb]
"""

from __future__ import annotations

import argparse
import json

from parallel_common import spawn
from plan_validation import validation_config
from tables import add_table_arguments, write_row

LOSSES = ("plain", "chunked", "chunked_recompute")


def measure(schedules: list[str], vocab: int, microbatches: int, seq: int = 128) -> dict[str, dict[str, int]]:
    """This rank's peak (bytes) per schedule and loss."""
    from meshformer.planner.measure import measure_step_peak

    out: dict[str, dict[str, int]] = {}
    for schedule in schedules:
        for loss in LOSSES:
            cfg = validation_config({"pp": 2, "pp_schedule": schedule, "pp_microbatches": microbatches}, vocab=vocab,
                                    seq=seq)
            cfg.train.loss = loss
            out.setdefault(schedule, {})[loss] = measure_step_peak(cfg)["peak"]
    return out


SUMMARY = ["`bench/pp_head_loss_memory.py`", "last pipeline stage's peak over plain: stored-gradient / recomputing "
           "chunked loss (pp=2, 4 micro-batches, V 32k, fp32)"]
NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved_1f1b", "interleaved_zb": "interleaved_zb",
         "zbv": "ZBV"}


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: per schedule, the chunked and the recomputing chunked loss's last-stage peak over
    the plain loss's."""
    cells = [f"{NAMES.get(r['schedule'], r['schedule'])} {r['last_stage_vs_plain']['chunked']:.2f} / "
             f"{r['last_stage_vs_plain']['chunked_recompute']:.2f}" for r in records]
    return [*SUMMARY, ", ".join(cells)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128, help="tokens per micro-batch (one sequence; d_model 128)")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zbv", "interleaved_zb"])
    add_table_arguments(parser)
    args = parser.parse_args()
    per_rank = spawn(2, measure, args.schedules, args.vocab, args.microbatches, args.seq)
    records = []
    for schedule in args.schedules:
        last = 0 if schedule == "zbv" else 1  # ZBV's V places the last stage on rank 0
        peaks = {loss: [rank[schedule][loss] for rank in per_rank] for loss in LOSSES}
        record = {
            "bench": "pp_head_loss_memory", "schedule": schedule, "vocab": args.vocab, "seq": args.seq,
            "microbatches": args.microbatches,
            "last_stage_mib": {loss: round(p[last] / 2**20, 2) for loss, p in peaks.items()},
            "last_stage_vs_plain": {loss: round(p[last] / peaks["plain"][last], 3) for loss, p in peaks.items()},
            "last_stage_recompute_vs_chunked": round(peaks["chunked_recompute"][last] / peaks["chunked"][last], 3),
            "worst_rank_vs_plain": {loss: round(max(p) / max(peaks["plain"]), 3) for loss, p in peaks.items()},
        }
        records.append(record)
        print(json.dumps(record))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
