"""Our chunked gated delta rule against `transformers`' PyTorch fallback (Qwen3-Next's
`torch_chunk_gated_delta_rule`), forward + backward, side by side.

Per shape (B, H, D, T; Dk = Dv = D, chunks of 64, L2-normalised q/k in the rule as Qwen3-Next calls it): rounds
alternating between the two sides after a warm-up round, median time per side, the ratio transformers / ours,
and the largest difference of the two outputs and of the q gradients. One JSON line per shape.

Both sides run the same GEMMs; ours saves the memory traffic around them (transformers' per-chunk slices and
in-place writes each cost a full-size zero-fill and copy in backward: N chunks x T, so the gap widens with T). On a
shared machine, `--threads 1 --clock cpu` gives the steadier figure (README's benchmark table).

    python bench/gated_delta.py [--shape B,H,D,T ...] [--dtype fp32] [--threads 2] [--rounds 5] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tables import add_table_arguments, write_row

from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.runtime.host_memory import apply_host_memory_policy

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = ["2,4,64,512", "2,4,128,1024", "2,8,128,2048"]  # B,H,D,T


def _inputs(batch: int, heads: int, dim: int, seq: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    g = F.logsigmoid(torch.randn(batch, seq, heads, generator=gen) + 3).to(dtype).requires_grad_()  # decay ~0.95
    beta = torch.rand(batch, seq, heads, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(batch, seq, heads, dim, generator=gen).to(dtype)
    return (q, k, v, g, beta), grad


def _sides() -> dict[str, Callable[..., torch.Tensor]]:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    return {"transformers": lambda *x: torch_chunk_gated_delta_rule(*x, chunk_size=64,
                                                                    use_qk_l2norm_in_kernel=True)[0],
            "ours": lambda *x: chunk_gated_delta_rule(*x, chunk_size=64, use_qk_l2norm=True)[0]}


def measure(shape: str, dtype: str, rounds: int, clock: str = "wall") -> dict:
    batch, heads, dim, seq = (int(s) for s in shape.split(","))
    inputs, grad = _inputs(batch, heads, dim, seq, DTYPES[dtype])
    sides = _sides()
    now = time.process_time if clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in sides}
    results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for r in range(rounds + 1):
        for name, fn in sides.items():
            for t in inputs:
                t.grad = None
            start = now()
            out = fn(*inputs)
            out.backward(grad)
            if r:  # the first round warms up
                times[name].append(now() - start)
            else:
                results[name] = (out.detach(), inputs[0].grad.detach())  # type: ignore[union-attr]
    median = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    (out_a, grad_a), (out_b, grad_b) = results["transformers"], results["ours"]
    return {"bench": "gated_delta", "batch": batch, "heads": heads, "head_dim": dim, "seq": seq, "dtype": dtype,
            "threads": torch.get_num_threads(), "clock": clock, "rounds": rounds,
            "load_1min": round(os.getloadavg()[0], 2),
            "transformers_ms": round(median["transformers"], 2), "ours_ms": round(median["ours"], 2),
            "speedup": round(median["transformers"] / median["ours"], 3),
            "out_max_diff": (out_a.float() - out_b.float()).abs().max().item(),
            "dq_max_diff": (grad_a.float() - grad_b.float()).abs().max().item()}


SUMMARY = ["`bench/gated_delta.py`", "our chunked gated delta rule (`meshformer/model/gated_delta.py`) vs "
           "`transformers`' PyTorch fallback `torch_chunk_gated_delta_rule`, fwd+bwd, same inputs and chunk 64"]


def table_row(records: list[dict]) -> list[str]:
    """training-01-cpu.json's row: transformers' time over ours per shape, and the largest output/dq difference."""
    threads, clock = records[0]["threads"], records[0]["clock"]
    speed = ", ".join(f"(B{r['batch']}, H{r['heads']}, D{r['head_dim']}, T{r['seq']}, {r['dtype']}) {r['speedup']:.2f}×"
                      for r in records)
    diff = max(max(r["out_max_diff"], r["dq_max_diff"]) for r in records)
    return [*SUMMARY, f"{threads} thread{'s' * (threads != 1)}, {'CPU' if clock == 'cpu' else 'wall'} time, "
                      f"transformers / ours: {speed}; outputs and dq within {diff:.0e}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    records = []
    for shape in args.shape:
        for dtype in args.dtype:
            records.append(measure(shape, dtype, args.rounds, args.clock))
            print(json.dumps(records[-1]), flush=True)
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
