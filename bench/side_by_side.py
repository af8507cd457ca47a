"""Two implementations of one function, forward + backward on the same inputs, timed side by side: what the kernel
benches (gated_delta.py, mamba2.py on CPU; gated_delta_fla.py, kda_fla.py, mamba2_ssm.py on one GPU) share.

    medians, results = run_sides(sides, inputs, grad, rounds)      # ms per side; [out, *input grads] per side
    report = gpu_comparison(medians, results, "fla", names, tolerance, "cuda")
    gpu_main(__doc__, "kda_fla", SHAPES, "B,H,D,T", TOLERANCE, fla_missing, measure)   # a GPU bench's command line
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence

import torch


def run_sides(sides: dict[str, Callable[..., torch.Tensor]], inputs: Sequence[torch.Tensor], grad: torch.Tensor,
              rounds: int, now: Callable[[], float] = time.perf_counter,
              sync: Callable[[], None] = lambda: None) -> tuple[dict[str, float], dict[str, list[torch.Tensor]]]:
    """Rounds alternate between the sides after one warm-up round (Triton compiles there); returns each side's
    median time in ms and, from the warm-up round, its output followed by every input's gradient."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    results: dict[str, list[torch.Tensor]] = {}
    for r in range(rounds + 1):
        for name, fn in sides.items():
            for t in inputs:
                t.grad = None
            sync()
            start = now()
            out = fn(*inputs)
            out.backward(grad.to(out.dtype))
            sync()
            if r:
                times[name].append(now() - start)
            else:
                results[name] = [out.detach()] + [t.grad.detach() for t in inputs]  # type: ignore[union-attr]
    return {name: sorted(ts)[len(ts) // 2] * 1e3 for name, ts in times.items()}, results


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def gpu_comparison(medians: dict[str, float], results: dict[str, list[torch.Tensor]], other: str,
                   names: Sequence[str], tolerance: float, device: str) -> dict:
    """The report's common tail: times of "ours" and `other`, ours / other, and each result's difference relative
    to ours, all within `tolerance` for "equal"."""
    diffs = {name: relative(a, b) for name, a, b in zip(names, results[other], results["ours"], strict=True)}
    return {"device": torch.cuda.get_device_name() if device == "cuda" else device,
            "ours_ms": round(medians["ours"], 3), f"{other}_ms": round(medians[other], 3),
            "speedup": round(medians["ours"] / medians[other], 3),
            "relative_diffs": {name: float(f"{d:.3e}") for name, d in diffs.items()},
            "tolerance": tolerance, "equal": all(d <= tolerance for d in diffs.values())}



def gpu_main(doc: str | None, bench: str, shapes: list[str], shape_help: str, tolerances: dict[str, float],
             library_missing: Callable[[], str | None], measure: Callable[..., dict]) -> None:
    """A GPU bench's command line: --shape, --dtype, --rounds, --tolerance; one JSON line per shape on CUDA, or one
    saying why it is skipped (no CUDA, or `library_missing()`'s reason)."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--shape", nargs="+", default=shapes, help=shape_help)
    parser.add_argument("--dtype", default="bf16", choices=sorted(tolerances))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=None, help="default: 2e-2 in bf16, 2e-3 in fp32")
    args = parser.parse_args()
    missing = "CUDA is not available" if not torch.cuda.is_available() else library_missing()
    if missing:
        print(json.dumps({"bench": bench, "status": "skipped", "reason": missing}), flush=True)
        return
    tolerance = args.tolerance if args.tolerance is not None else tolerances[args.dtype]
    for shape in args.shape:
        print(json.dumps(measure(shape, args.dtype, args.rounds, tolerance, "cuda")), flush=True)
