"""Our chunked gated delta rule against `transformers`' PyTorch fallback (Qwen3-Next's
`torch_chunk_gated_delta_rule`), forward + backward, side by side; `--rule kda`: with a decay per key channel
(Kimi Delta Attention) against Kimi Linear's `chunk_kimi_delta_attention`.

Per shape (B, H, D, T; Dk = Dv = D, chunks of 64, L2-normalised q/k in the rule as Qwen3-Next calls it): rounds
alternating between the two sides after a warm-up round, median time per side, the ratio transformers / ours,
and the largest difference of the two outputs and of the q gradients. One JSON line per shape.

Both sides run the same GEMMs; ours saves the memory traffic around them (transformers' per-chunk slices and
in-place writes each cost a full-size zero-fill and copy in backward: N chunks x T, so the gap widens with T). On a
shared machine, `--threads 1 --clock cpu` gives the steadier figure (README's benchmark table).

    python bench/gated_delta.py [--rule gated_delta|kda] [--shape B,H,D,T ...] [--dtype fp32] [--threads 2]
                                [--rounds 5] [--clock wall|cpu] [--table PATH --machine TEXT]
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

from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.runtime.host_memory import apply_host_memory_policy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = ["2,4,64,512", "2,4,128,1024", "2,8,128,2048"]  # B,H,D,T


def _inputs(batch: int, heads: int, dim: int, seq: int, dtype: torch.dtype, seed: int = 0, rule: str = "gated_delta"):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    decays = (batch, seq, heads, dim) if rule == "kda" else (batch, seq, heads)  # kda: one per key channel
    g = F.logsigmoid(torch.randn(decays, generator=gen) + 3).to(dtype).requires_grad_()  # decay ~0.95
    beta = torch.rand(batch, seq, heads, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype)
    return (q, k, v, g, beta), grad


def _sides(rule: str) -> dict[str, Callable[..., torch.Tensor]]:
    if rule == "kda":
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention as theirs
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as theirs

    return {"transformers": lambda *x: theirs(*x, chunk_size=64, use_qk_l2norm_in_kernel=True)[0],
            "ours": lambda *x: chunk_gated_delta_rule(*x, chunk_size=64, use_qk_l2norm=True)[0]}


def measure(shape: str, dtype: str, rounds: int, clock: str = "wall", rule: str = "gated_delta") -> dict:
    batch, heads, dim, seq = (int(s) for s in shape.split(","))
    inputs, grad = _inputs(batch, heads, dim, seq, DTYPES[dtype], rule=rule)
    sides = _sides(rule)
    now = time.process_time if clock == "cpu" else time.perf_counter
    medians, results = run_sides(sides, inputs, grad, rounds, now=now)
    (out_a, grad_a, *_), (out_b, grad_b, *_) = results["transformers"], results["ours"]
    return {"bench": rule, "batch": batch, "heads": heads, "head_dim": dim, "seq": seq, "dtype": dtype,
            "threads": torch.get_num_threads(), "clock": clock, "rounds": rounds,
            "load_1min": round(os.getloadavg()[0], 2),
            "transformers_ms": round(medians["transformers"], 2), "ours_ms": round(medians["ours"], 2),
            "speedup": round(medians["transformers"] / medians["ours"], 3),
            "out_max_diff": (out_a.float() - out_b.float()).abs().max().item(),
            "dq_max_diff": (grad_a.float() - grad_b.float()).abs().max().item()}


def table(results: list[dict]) -> tuple[list[str], list[list[str]]]:
    columns = ["B, H, D, T", "dtype", "transformers ms", "ours ms", "transformers / ours", "largest Δ out",
               "largest Δ dq"]
    rows = [[f"{r['batch']}, {r['heads']}, {r['head_dim']}, {r['seq']}", r["dtype"], f"{r['transformers_ms']:.1f}",
             f"{r['ours_ms']:.1f}", f"{r['speedup']:.2f}", f"{r['out_max_diff']:.1e}", f"{r['dq_max_diff']:.1e}"]
            for r in results]
    return columns, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rule", default="gated_delta", choices=["gated_delta", "kda"],
                        help="kda: a decay per key channel, against Kimi Linear's chunk_kimi_delta_attention")
    parser.add_argument("--shape", nargs="+", default=SHAPES, help="B,H,D,T")
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
            results.append(measure(shape, dtype, args.rounds, args.clock, args.rule))
            print(json.dumps(results[-1]), flush=True)
    if args.table:
        columns, rows = table(results)
        threads = torch.get_num_threads()
        kda = args.rule == "kda"
        notes = ("Both sides run the same GEMMs; transformers' per-chunk slices and in-place writes each cost a "
                 "full-size zero-fill and copy in backward, so the gap widens with T.")
        if kda:
            notes = ("transformers forms every within-chunk pair's decay per channel (C x C x Dk per chunk) and "
                     "inverts the chunk's triangular system row by row; ours computes the pairs within blocks of 16 "
                     "tokens directly and across blocks as GEMMs, and solves the system at once.")
        write_table(args.table, machine=args.machine, page="architectures",
                    title=("Chunked KDA rule against transformers' chunk_kimi_delta_attention" if kda else
                           "Chunked gated delta rule against transformers' torch_chunk_gated_delta_rule"),
                    command=(f"python bench/gated_delta.py{' --rule kda' if kda else ''} --shape "
                             f"{' '.join(args.shape)} --dtype {' '.join(args.dtype)} --threads {threads} "
                             f"--rounds {args.rounds} --clock {args.clock}"),
                    setup=(f"Forward + backward of the rule alone (Dk = Dv = D, chunks of 64, L2-normalised q and k "
                           f"in the rule{', a decay per key channel' if kda else ''}), {threads} thread(s), medians "
                           f"of {args.rounds} alternating rounds of "
                           f"{'this process' + chr(39) + 's CPU time' if args.clock == 'cpu' else 'wall time'}; the "
                           "differences are between the two sides' outputs and query gradients."),
                    notes=notes, columns=columns, rows=rows, align=["l", "l", "r", "r", "r", "r", "r"])


if __name__ == "__main__":
    main()
