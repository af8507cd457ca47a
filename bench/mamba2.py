"""Our chunked Mamba-2 scan (meshformer/model/ssd.py: `chunk_ssd`) against `transformers`' PyTorch path
(NemotronH's `mamba2_chunk_scan`, the same function as Mamba2's and Falcon-H1's torch fallbacks), forward + backward,
side by side.

Per shape (B, H, P, N, G, T: heads, head width, state size, groups sharing B and C, tokens; chunks of 64): the same
inputs to both sides (dt already positive, no skip D: each side's scan alone), rounds alternating between the two
sides after a warm-up round, median time per side, the ratio transformers / ours, and the largest difference of the
outputs and of the x gradients. One JSON line per shape.

    python bench/mamba2.py [--shape B,H,P,N,G,T ...] [--dtype fp32] [--threads 2] [--rounds 5]
                           [--clock wall|cpu] [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import run_sides
from tables import add_table_arguments, write_table

from meshformer.model.ssd import chunk_ssd
from meshformer.runtime.host_memory import apply_host_memory_policy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = ["2,8,64,64,1,512", "2,8,64,64,1,1024", "2,8,64,64,1,2048"]  # B,H,P,N,G,T
CHUNK = 64


def _inputs(batch: int, heads: int, width: int, size: int, groups: int, seq: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, heads, width, generator=gen).to(dtype).requires_grad_()
    dt = F.softplus(torch.randn(batch, seq, heads, generator=gen) - 3).to(dtype).requires_grad_()
    A = (-torch.rand(heads, generator=gen) * 4 - 0.5).requires_grad_()
    B, C = (torch.randn(batch, seq, groups, size, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    grad = torch.randn(batch, seq, heads, width, generator=gen).to(dtype)
    return (x, dt, A, B, C), grad


def _sides() -> dict[str, Callable[..., torch.Tensor]]:
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    return {"transformers": lambda *x: mamba2_chunk_scan(*x, chunk_size=CHUNK),
            "ours": lambda *x: chunk_ssd(*x, chunk_size=CHUNK)[0]}


def measure(shape: str, dtype: str, rounds: int, clock: str = "wall") -> dict:
    batch, heads, width, size, groups, seq = (int(s) for s in shape.split(","))
    inputs, grad = _inputs(batch, heads, width, size, groups, seq, DTYPES[dtype])
    sides = _sides()
    now = time.process_time if clock == "cpu" else time.perf_counter
    medians, results = run_sides(sides, inputs, grad, rounds, now=now)
    (out_a, grad_a, *_), (out_b, grad_b, *_) = results["transformers"], results["ours"]
    return {"bench": "mamba2", "batch": batch, "heads": heads, "head_dim": width, "state_size": size,
            "groups": groups, "seq": seq, "dtype": dtype, "threads": torch.get_num_threads(), "clock": clock,
            "rounds": rounds, "load_1min": round(os.getloadavg()[0], 2),
            "transformers_ms": round(medians["transformers"], 2), "ours_ms": round(medians["ours"], 2),
            "speedup": round(medians["transformers"] / medians["ours"], 3),
            "out_max_diff": (out_a.float() - out_b.float()).abs().max().item(),
            "dx_max_diff": (grad_a.float() - grad_b.float()).abs().max().item()}


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = ["B, H, P, N, G, T", "dtype", "transformers ms", "ours ms", "transformers / ours", "largest Δ out",
               "largest Δ dx"]
    rows = [[f"{r['batch']}, {r['heads']}, {r['head_dim']}, {r['state_size']}, {r['groups']}, {r['seq']}",
             r["dtype"], f"{r['transformers_ms']:.1f}", f"{r['ours_ms']:.1f}", f"{r['speedup']:.2f}",
             f"{r['out_max_diff']:.1e}", f"{r['dx_max_diff']:.1e}"] for r in results]
    return columns, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", nargs="+", default=SHAPES, help="B,H,P,N,G,T")
    parser.add_argument("--dtype", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: this process's CPU time (with --threads 1, steadier on a loaded machine)")
    add_table_arguments(parser)
    args = parser.parse_args()
    apply_host_memory_policy("cpu", 1)  # as the trainer does for one CPU process
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for shape in args.shape:
        for dtype in args.dtype:
            results.append(measure(shape, dtype, args.rounds, args.clock))
            print(json.dumps(results[-1]), flush=True)
    if args.table:
        columns, rows = table(results)
        threads = torch.get_num_threads()
        write_table(args.table, machine=args.machine, page="architectures",
                    title="Chunked Mamba-2 scan against transformers' mamba2_chunk_scan",
                    command=(f"python bench/mamba2.py --shape {' '.join(args.shape)} --dtype {' '.join(args.dtype)} "
                             f"--threads {threads} --rounds {args.rounds} --clock {args.clock}"),
                    setup=(f"Forward + backward of the scan alone (chunks of {CHUNK}, dt given positive, no skip D), "
                           f"{threads} thread(s), medians of {args.rounds} alternating rounds of "
                           f"{'this process' + chr(39) + 's CPU time' if args.clock == 'cpu' else 'wall time'}; the "
                           "differences are between the two sides' outputs and x gradients."),
                    notes=("transformers relates every chunk to every earlier chunk at once (an N x N decay matrix "
                           "over the chunks), repeats B and C to every head and leaves the backward to autograd; "
                           "ours carries the state chunk by chunk, forms C B^T once per group, and runs its own "
                           "backward for the within-chunk products and the chunk-to-chunk states."),
                    columns=columns, rows=rows, align=["l", "l", "r", "r", "r", "r", "r"])


if __name__ == "__main__":
    main()
