"""Where a training step's time goes: torch.profiler over our Trainer step and the nanoGPT-style reference.

On CPU: groups self CPU time by operator family (matmuls, attention, softmax/cross-entropy, norms, elementwise,
casts, optimizer, clipping, ...) for both sides, so the difference between them can be read off directly; lists
the top operators by self time, and times each phase of the step (bench/step_phases.py).
On CUDA: the same for GPU kernel time, by kernel family (GEMMs, attention, inductor's fused Triton kernels,
optimizer, ...), and how much of the synchronised step the GPU was busy (the rest: launch or host bound).

    python bench/profile_step.py --shape S --dtype bf16 [--steps 5] [--variant off+chunked]
    python bench/profile_step.py --shape llama-1b --device cuda --variant blocks+cudnn+plain --sides ours --steps 3

The variant configures our side; the reference takes only its compile setting (an FP8 variant profiles our FP8 step
against the bf16 reference).
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
from speed_sweep import parse_variant
from step_common import bench_config, random_tokens, reset_memory, sync, timed
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
KERNEL_FAMILIES = [  # CUDA kernel names; first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "matmul")),
    ("optimizer", ("adam", "multi_tensor")),
    ("triton_fused", ("triton",)),
    ("softmax_ce", ("softmax", "cross_entropy", "nll", "logsumexp")),
    ("norm", ("layer_norm", "rms_norm", "layernorm", "rmsnorm")),
    ("memcpy_memset", ("memcpy", "memset")),
    ("elementwise_reduce", ("elementwise", "vectorized", "reduce", "copy", "fill")),
]


def family(name: str, families: list[tuple[str, tuple[str, ...]]] = FAMILIES) -> str:
    low = name.lower()
    for fam, keys in families:
        if any(k in low for k in keys):
            return fam
    return "other"


def breakdown(step, steps: int, top: int, device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """Milliseconds per step by family (self CPU time of operators; on CUDA, GPU time of kernels), and the `top`
    operators or kernels by that time."""
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    totals: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = {}
    events = prof.key_averages()
    # record_function ranges (e.g. "Optimizer.step#AdamW.step") also appear on the GPU timeline, spanning kernels
    # already counted: only kernels, whose names no CPU event has, are summed.
    cpu_names = {e.key for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    for event in events:
        if gpu:
            if event.device_type != torch.autograd.DeviceType.CUDA or event.key in cpu_names:
                continue
            ms = event.self_device_time_total / 1e3 / steps
            totals[family(event.key, KERNEL_FAMILIES)] += ms
        else:
            ms = event.self_cpu_time_total / 1e3 / steps
            if event.key.startswith("aten::") or "Optimizer" in event.key:
                totals[family(event.key.removeprefix("aten::"))] += ms
        ops[event.key[:120]] = ms
    by_family = {k: round(v, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    top_ops = {k: round(v, 2) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]}
    return by_family, top_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="S")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--variant", default="off", help="ours: compile, loss, kernels as in bench/speed_sweep.py")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sides", nargs="+", default=["reference", "ours"], choices=["reference", "ours"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15, help="operators listed by self time")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: process CPU time for steps and phases (with --threads 1 on a loaded machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    compile, loss, extra = parse_variant(args.variant)
    cfg = bench_config(args.shape, dtype=args.dtype, device=args.device, compile=compile, loss=loss, extra=extra)
    device = torch.device(args.device)
    tokens = random_tokens(cfg.model.vocab_size, device)
    makers = {"reference": lambda: Reference(cfg, tokens, device, compile=compile != "off"),
              "ours": lambda: Ours(cfg, tokens)}
    for name in args.sides:
        reset_memory(device)
        step = makers[name]()
        timed(step, 2, device)  # warm-up (compilation happens here)
        ms = timed(step, args.steps, device, args.clock) * 1e3
        by_family, top_ops = breakdown(step, args.steps, args.top, device)
        record = {"bench": "profile_step", "side": name, "shape": args.shape, "dtype": args.dtype,
                  "variant": args.variant, "clock": args.clock, "step_ms": round(ms, 1)}
        if device.type == "cuda":
            record |= {"device": torch.cuda.get_device_name(device),
                       "gpu_busy_ms_per_step": round(sum(by_family.values()), 1),
                       "gpu_ms_per_step": by_family, "top_kernels_ms_per_step": top_ops}
        else:
            record |= {"threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
                       "phase_ms_per_step": phase_breakdown(name, step, args.steps, args.clock),
                       "self_cpu_ms_per_step": by_family, "top_ops_ms_per_step": top_ops}
        print(json.dumps(record), flush=True)
        del step


if __name__ == "__main__":
    main()
