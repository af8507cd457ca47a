"""Our blockwise CPU attention kernel against torch's SDPA (CPU flash kernel), forward + backward, side by side.

Per shape: the attention of one layer at the GPT shapes of bench/vs_nanogpt.py (q, k, v laid out as the
projections leave them), rounds alternating between the two, median time per side, the ratio SDPA / ours, and
each side's relative error against a float64 reference (sharp attention: scores ~3x unit scale). One JSON line
per shape and dtype.

Why the kernel exists (2 threads, bf16, heads of 64, T 256-512): torch's CPU flash kernel runs its backward at
2.3-2.9x its forward, the pair at ~70 GFLOP/s where the machine's GEMMs reach ~390. Ours: bf16 1.47x at
(B8, H8, T512), 1.31x at (B8, H12, T256), 1.16x at (B16, H4, T256); fp32 1.03-1.33x; about even at T 1024
(B2, H8), no gain at T 2048 (so `auto` stops at T <= 16 * head_dim).

    python bench/cpu_attention.py [--shape S M G] [--dtype bf16 fp32] [--threads 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from step_common import GPT_SHAPES
from tables import add_table_arguments, write_row

from meshformer.model.blockwise_attention import blockwise_attention
from meshformer.runtime.host_memory import apply_host_memory_policy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _inputs(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(batch, seq, heads, head_dim, generator=g).mul_(3 if i < 2 else 1).to(dtype)
                     .transpose(1, 2) for i in range(4))  # (B, H, T, D) views of (B, T, H, D), as projected
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad


def _sides(head_dim: int):
    return {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "blockwise": lambda q, k, v: blockwise_attention(q, k, v, scale=head_dim**-0.5, causal=True)}


def _errors(fn, q, k, v, grad) -> float:
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    out64.backward(grad.double())
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    pairs = zip([out, q.grad, k.grad, v.grad], [out64, q64.grad, k64.grad, v64.grad], strict=True)
    return max(((a.double() - b).norm() / b.norm()).item() for a, b in pairs)


def measure(shape: str, dtype: str, rounds: int) -> dict:
    _, d, heads, seq, _, batch = GPT_SHAPES[shape]
    head_dim = d // heads
    q, k, v, grad = _inputs(batch, heads, seq, head_dim, DTYPES[dtype])
    sides = _sides(head_dim)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds + 1):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn(q, k, v).backward(grad)
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    median = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    return {"bench": "cpu_attention", "shape": shape, "dtype": dtype, "batch": batch, "heads": heads, "seq": seq,
            "head_dim": head_dim, "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
            "sdpa_ms": round(median["sdpa"], 2), "blockwise_ms": round(median["blockwise"], 2),
            "speedup": round(median["sdpa"] / median["blockwise"], 3),
            "sdpa_error": _errors(sides["sdpa"], q, k, v, grad),
            "blockwise_error": _errors(sides["blockwise"], q, k, v, grad)}


SUMMARY = ["`bench/cpu_attention.py`", "our blockwise CPU attention kernel vs SDPA's CPU flash kernel, fwd+bwd of one "
           "layer, and both errors vs float64"]


def table_row(records: list[dict]) -> list[str]:
    """training-01-cpu.json's row: SDPA's time over ours per dtype and shape, and the largest errors vs float64."""
    by_dtype: dict[str, list[str]] = {}
    for r in records:
        by_dtype.setdefault(r["dtype"], []).append(f"{r['shape']} {r['speedup']:.2f}×")
    threads = records[0]["threads"]
    speed = "; ".join(f"{dtype} {', '.join(cells)}" for dtype, cells in by_dtype.items())
    worst = {side: max(r[f"{side}_error"] for r in records) for side in ("blockwise", "sdpa")}
    return [*SUMMARY, f"{threads} thread{'s' * (threads != 1)}, one layer fwd+bwd, SDPA time / ours: {speed}; "
                      f"largest error vs float64 {worst['blockwise']:.1e} (ours) vs {worst['sdpa']:.1e} (SDPA)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", nargs="+", default=["S", "M", "G"], choices=sorted(GPT_SHAPES))
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    add_table_arguments(parser)
    args = parser.parse_args()
    apply_host_memory_policy("cpu", 1)  # as the trainer does for one CPU process
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for shape in args.shape:
        for dtype in args.dtype:
            records.append(measure(shape, dtype, args.rounds))
            print(json.dumps(records[-1]), flush=True)
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
