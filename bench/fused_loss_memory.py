"""Peak memory and time of the output projection + loss: full logits (plain) vs chunked (gradients stored by the
forward, or recomputed by the backward) vs liger vs the same chunks through autograd with activation checkpointing
(each chunk's logits recomputed in the backward: what the hand-derived backwards must beat), in one run.

Forward and backward of `hidden (B·T, D) -> logits (B·T, V) -> summed cross-entropy` with the weight as a
parameter, like the model's head. Peak memory is what the head adds on top of its inputs: on CUDA from the
allocator (`max_memory_allocated`), on CPU from torch's live-tensor accounting (`MemTracker`, every tensor
created while the head runs). Time: the fastest of --repeat untracked runs (CPU: process CPU time; run with
OMP_NUM_THREADS=1 for one thread). --zero-bubble runs the backward as a zero-bubble pipeline stage does (an input
pass, then the weight pass). Each variant also reports its loss and gradient error against plain fp32.

The CPU default chunk size (`default_chunk_rows`: in cache, at least 2·d_model rows) against 128 MiB chunks,
head only, 1 thread: S/M (V 4096, 512 rows) 1.1-1.4x faster, G (V 50304, D 768, 1536 rows) 1.1x.

    python bench/fused_loss_memory.py --shape llama-1b-head-small     # CPU: Llama-1B head ratios, scaled down
    python bench/fused_loss_memory.py --shape llama-1b-head --dtype bf16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.loss.fused import (
    chunked_linear_cross_entropy,
    default_chunk_rows,
    liger_available,
    liger_linear_cross_entropy,
)

# rows (B·T), d_model, vocab
SHAPES = {
    "tiny": (256, 64, 1000),
    "llama-1b-head-small": (2048, 512, 32064),  # Llama-1B's V/D (~63) and rows/D (4), a quarter of each size
    "llama-1b-head": (8192, 2048, 128256),  # B 4 x T 2048, d 2048, V 128256
}


def head_loss(kind: str, h, w, y, label_smoothing: float, z_loss: float) -> torch.Tensor:
    if kind == "plain":
        return cross_entropy_sum(F.linear(h, w), y, label_smoothing=label_smoothing, z_loss=z_loss)
    if kind == "liger":
        return liger_linear_cross_entropy(h, y, w, label_smoothing=label_smoothing, z_loss=z_loss)
    if kind == "autograd_checkpointed":  # the reference a hand-derived backward must beat: chunks through autograd
        rows = default_chunk_rows(h.shape[0], w.shape[0], w.shape[1], h.device)

        def chunk(h_c: torch.Tensor, y_c: torch.Tensor) -> torch.Tensor:
            return cross_entropy_sum(F.linear(h_c, w), y_c, label_smoothing=label_smoothing, z_loss=z_loss)

        return sum(checkpoint(chunk, h[i:i + rows], y[i:i + rows], use_reentrant=False)
                   for i in range(0, h.shape[0], rows))
    return chunked_linear_cross_entropy(h, y, w, label_smoothing=label_smoothing, z_loss=z_loss,
                                        recompute=kind == "chunked_recompute")


def measure(kind: str, h0, w0, y, dtype, device, args) -> dict:
    h = h0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def run() -> torch.Tensor:
        with autocast:
            loss = head_loss(kind, h, w, y, args.label_smoothing, args.z_loss) / y.numel()
        if args.zero_bubble:  # as torch's zero-bubble stage: gradients of the input, then of the weight
            from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

            _, groups = stage_backward_input([loss], None, [h], iter([w]))
            stage_backward_weight(iter([w]), groups)
        else:
            loss.backward()
        return loss.detach() * y.numel()

    clock = time.perf_counter if device.type == "cuda" else time.process_time
    seconds = []
    for _ in range(max(args.repeat, 1) + (device.type == "cuda")):  # CUDA: one warm-up (kernels, autotuning)
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = clock()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(clock() - start)
    h.grad = w.grad = None  # the peak run starts from no gradients, as the timed ones did
    if device.type == "cuda":
        seconds = seconds[1:]
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = run()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(h, w, y)
        with tracker:
            loss = run()
        snapshot = tracker.get_tracker_snapshot("peak")[device]
        peak = snapshot["Total"] - snapshot[next(k for k in snapshot if str(k).endswith("OTH"))]
    return {"loss": float(loss), "grad_h": h.grad.float(), "grad_w": w.grad.float(), "peak_bytes": peak,
            "seconds": min(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b-head-small", choices=list(SHAPES))
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--label-smoothing", type=float, default=0.0)
    parser.add_argument("--z-loss", type=float, default=0.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--zero-bubble", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    rows, d, vocab = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(rows, d, generator=gen).to(device)
    w0 = (torch.randn(vocab, d, generator=gen) * 0.02).to(device)
    y = torch.randint(vocab, (rows,), generator=gen).to(device)
    kinds = ["plain", "chunked", "chunked_recompute", "autograd_checkpointed"]
    kinds += ["liger"] if device.type == "cuda" and liger_available() and not args.zero_bubble else []
    results = {k: measure(k, h0, w0, y, dtype, device, args) for k in kinds}
    plain = results["plain"]
    for kind, r in results.items():
        rel = {g: float((r[g] - plain[g]).norm() / plain[g].norm().clamp_min(1e-30)) for g in ("grad_h", "grad_w")}
        print(json.dumps({
            "bench": "fused_loss_memory", "shape": args.shape, "rows": rows, "d_model": d, "vocab": vocab,
            "dtype": args.dtype, "device": str(device), "kind": kind, "peak_mib": round(r["peak_bytes"] / 2**20, 1),
            "zero_bubble": args.zero_bubble, "peak_vs_plain": round(r["peak_bytes"] / plain["peak_bytes"], 3),
            "seconds": round(r["seconds"], 4), "time_vs_plain": round(r["seconds"] / plain["seconds"], 3),
            "loss": r["loss"], "loss_rel_err": abs(r["loss"] - plain["loss"]) / abs(plain["loss"]),
            "grad_h_rel_err": rel["grad_h"], "grad_w_rel_err": rel["grad_w"],
        }), flush=True)


if __name__ == "__main__":
    main()
