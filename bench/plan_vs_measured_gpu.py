"""Planner vs `torch.cuda.max_memory_allocated` for a ~1B Llama on one GPU, per recomputation mode (< 2 minutes).

Each mode trains two steps (bf16 autocast, fused AdamW) of configs/llama-1b.toml at seq 2048; the peak of the
second step, as the CUDA caching allocator counts it (bytes handed to live tensors), is compared with the
planner's prediction for world size 1. `--device cpu` dry-runs the same path on a small model, measuring live
tensor bytes instead (see meshformer/planner/measure.py).

    python bench/plan_vs_measured_gpu.py                      # on a GPU
    python bench/plan_vs_measured_gpu.py --device cpu         # dry run
    python bench/plan_vs_measured_gpu.py --config olmoe-1b-7b --set model.n_layers=4 --modes none full   # MoE
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
from tables import add_table_arguments, write_table

from meshformer.config import load_config
from meshformer.planner.measure import LiveTensorBytes, TrainingStep
from meshformer.planner.search import plan_layout

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=256", "model.n_layers=4", "model.attention.n_heads=8", "model.attention.n_kv_heads=4",
         "model.ffn.d_ff=1024",
         "model.vocab_size=4096", "data.seq_len=256", "model.max_seq_len=256"]


def measure(cfg, device: torch.device) -> int:
    step = TrainingStep(cfg, device)
    step()  # the first step creates the optimizer state
    if device.type != "cuda":
        with LiveTensorBytes(*step.state_tensors()) as tracker:
            step()
        return tracker.peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


RECOMPUTE = {"every_k": "every 2nd block"}


def table_rows(rows: list[dict]) -> list[list[str]]:
    """One row per recomputation mode: the planner's error against the measured peak."""
    return [[RECOMPUTE.get(r["recompute"], r["recompute"]), f"{100 * r['error']:+.1f}%".replace("-", "−")]
            for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["none", "selective", "full", "every_k"])
    parser.add_argument("--config", default="llama-1b", help="a config under configs/")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides, e.g. model.n_layers=4")
    add_table_arguments(parser)
    args = parser.parse_args()
    device = torch.device(args.device)
    # One micro-batch per step, as measured: no gradients held from an earlier micro-batch.
    base = [f"train.device={device.type}", "train.dtype=bf16", "train.grad_accum=1", f"data.batch_size={args.batch}",
            "data.seq_len=2048"]
    if device.type == "cpu":
        base += SMALL
    base += args.set
    rows = []
    for mode in args.modes:
        start = time.perf_counter()
        cfg = load_config(ROOT / "configs" / f"{args.config}.toml", [*base, f"parallel.recompute={mode}"])
        predicted = plan_layout(cfg, 1).peak
        measured = measure(cfg, device)
        gc.collect()  # the previous mode's model and optimizer are gone before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append({"recompute": mode, "predicted_gib": predicted / 2**30, "measured_gib": measured / 2**30,
                     "error": predicted / measured - 1, "seconds": time.perf_counter() - start})
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.table:
        measured = "`torch.cuda.max_memory_allocated`" if device.type == "cuda" else "live tensor bytes"
        shape = "seq 2048" if device.type == "cuda" else "a small shape (CPU dry run)"
        extra = f", {' '.join(args.set)}" if args.set else ""
        write_table(args.table, machine=args.machine or f"one {name} (torch {torch.__version__})", page="parallel",
                    title="Memory planner on a GPU", command="python bench/plan_vs_measured_gpu.py",
                    setup=f"`configs/{args.config}.toml` at {shape}, batch {args.batch}, bf16, the default fused head "
                          f"loss{extra}; measured is {measured}.",
                    columns=["recompute", "predicted against measured"], align=["l", "r"], rows=table_rows(rows))
    print(f"{name}: largest error {100 * max(abs(r['error']) for r in rows):.1f}% over {len(rows)} modes")


if __name__ == "__main__":
    main()
