"""Where a training step's time goes: torch.profiler over our Trainer step and the nanoGPT-style reference.

Groups CPU self time by operator family (matmuls, attention, softmax/cross-entropy, norms, elementwise,
casts, optimizer, clipping, ...) for both sides, so the difference between them can be read off directly;
lists the top operators by self time, and times each phase of the step (bench/step_phases.py).

    python bench/profile_step.py --shape S --dtype bf16 [--steps 5] [--loss auto]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_common import bench_config, random_tokens, timed
from step_phases import phase_breakdown
from vs_nanogpt import Ours, Reference

FAMILIES = [  # first match wins
    ("optimizer", ("adam", "_fused_adamw", "_foreach_", "lerp", "addcdiv", "addcmul")),
    ("clip_grad", ("norm", "clamp", "_foreach_mul")),
    ("matmul", ("mm", "addmm", "bmm", "linear", "matmul")),
    ("attention", ("attention", "sdpa", "flash")),
    ("softmax_ce", ("softmax", "cross_entropy", "nll_loss", "logsumexp", "gather", "scatter")),
    ("norm", ("layer_norm", "rms_norm")),
    ("cast_copy", ("to_copy", "copy_", "_to_", "clone", "contiguous")),
    ("gelu_act", ("gelu", "silu")),
    ("embedding", ("embedding",)),
    ("elementwise", ("add", "mul", "sub", "div", "exp", "sum", "fill", "zero", "where", "mean")),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def breakdown(step, steps: int, top: int) -> tuple[dict[str, float], dict[str, float]]:
    """Self CPU milliseconds per step by operator family, and the `top` operators by self time."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    totals: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = {}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        if event.key.startswith("aten::") or "Optimizer" in event.key:
            totals[family(event.key.removeprefix("aten::"))] += ms
        ops[event.key] = ms
    by_family = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    top_ops = {k: round(v, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]}
    return by_family, top_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--loss", default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="operators listed by self time")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: process CPU time for steps and phases (with --threads 1 on a loaded machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = bench_config(args.shape, dtype=args.dtype, device="cpu", loss=args.loss)
    device = torch.device("cpu")
    tokens = random_tokens(cfg.model.vocab_size, device)
    sides = {"reference": Reference(cfg, tokens, device, compile=False), "ours": Ours(cfg, tokens)}
    for name, step in sides.items():
        timed(step, 2, device)  # warm-up
        ms = timed(step, args.steps, device, args.clock) * 1e3
        by_family, top_ops = breakdown(step, args.steps, args.top)
        print(json.dumps({"bench": "profile_step", "side": name, "shape": args.shape, "dtype": args.dtype,
                          "loss": args.loss, "threads": torch.get_num_threads(), "clock": args.clock,
                          "load_1min": round(os.getloadavg()[0], 2), "step_ms": round(ms, 1),
                          "phase_ms_per_step": phase_breakdown(name, step, args.steps, args.clock),
                          "self_cpu_ms_per_step": by_family, "top_ops_ms_per_step": top_ops}), flush=True)


if __name__ == "__main__":
    main()
