"""Our chunked KDA rule (model/gated_delta.py with a decay per key channel) against flash-linear-attention's
`chunk_kda` through model/gated_delta_fla.py (kda blocks with linear_attention.backend = "fla"), forward + backward
on one GPU.

Per shape (B, H, D, T; Dk = Dv = D, Kimi-Linear-48B-A3B's 32 heads of width 128 by default; L2-norm of q/k inside
the rule, as the blocks call it): the same inputs to both sides, rounds alternating between them after
a warm-up round, the median time per side and the ratio ours / fla (> 1: fla faster). Equality: the largest
difference of the outputs and of every input's gradient, each relative to the largest magnitude of ours, must be
within --tolerance (default 2e-2 in bf16: fla keeps bf16 intermediates where ours computes in fp32; 2e-3 in fp32,
where Triton's dots may run TF32). One JSON line per shape; where fla or CUDA is missing, one line saying so.

    python bench/kda_fla.py [--shape B,H,D,T ...] [--dtype bf16] [--rounds 5] [--tolerance X]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.model.gated_delta_fla import fla_importable, fla_kda_rule

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"bf16": 2e-2, "fp32": 2e-3}
SHAPES = ["1,32,128,2048", "1,32,128,8192"]  # B,H,D,T


def _inputs(batch: int, heads: int, dim: int, seq: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) + shift).to(device, dtype).requires_grad_()

    q, k, v = (leaf(batch, seq, heads, dim) for _ in range(3))
    g = F.logsigmoid(torch.randn(batch, seq, heads, dim, generator=gen) + 3).to(device, dtype).requires_grad_()
    beta = torch.rand(batch, seq, heads, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(batch, seq, heads, dim, generator=gen).to(device, dtype)
    return (q, k, v, g, beta), grad


def _sides() -> dict[str, Callable[..., torch.Tensor]]:
    return {"ours": lambda *x: chunk_gated_delta_rule(*x, chunk_size=64, use_qk_l2norm=True)[0],
            "fla": lambda *x: fla_kda_rule(*x, use_qk_l2norm=True)[0]}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def measure(shape: str, dtype: str, rounds: int, tolerance: float, device: str) -> dict:
    batch, heads, dim, seq = (int(s) for s in shape.split(","))
    inputs, grad = _inputs(batch, heads, dim, seq, DTYPES[dtype], device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"ours": [], "fla": []}
    results: dict[str, list[torch.Tensor]] = {}
    for r in range(rounds + 1):
        for name, fn in _sides().items():
            for t in inputs:
                t.grad = None
            sync()
            start = time.perf_counter()
            out = fn(*inputs)
            out.backward(grad)
            sync()
            if r:  # the first round warms up (Triton compiles)
                times[name].append(time.perf_counter() - start)
            else:
                results[name] = [out.detach()] + [t.grad.detach() for t in inputs]  # type: ignore[union-attr]
    median = {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    diffs = {name: _relative(a, b) for name, a, b in zip(names, results["fla"], results["ours"], strict=True)}
    return {"bench": "kda_fla", "batch": batch, "heads": heads, "head_dim": dim,
            "seq": seq, "dtype": dtype, "rounds": rounds,
            "device": torch.cuda.get_device_name() if device == "cuda" else device,
            "ours_ms": round(median["ours"], 3), "fla_ms": round(median["fla"], 3),
            "speedup": round(median["ours"] / median["fla"], 3),
            "relative_diffs": {name: float(f"{d:.3e}") for name, d in diffs.items()},
            "tolerance": tolerance, "equal": all(d <= tolerance for d in diffs.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", nargs="+", default=SHAPES, help="B,H,D,T")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=None, help="default: 2e-2 in bf16, 2e-3 in fp32")
    args = parser.parse_args()
    missing = ("CUDA is not available" if not torch.cuda.is_available() else
               "flash-linear-attention is not installed (pip install 'meshformer[fla]')" if not fla_importable()
               else None)
    if missing:
        print(json.dumps({"bench": "kda_fla", "status": "skipped", "reason": missing}), flush=True)
        return
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    for shape in args.shape:
        print(json.dumps(measure(shape, args.dtype, args.rounds, tolerance, "cuda")), flush=True)


if __name__ == "__main__":
    main()
