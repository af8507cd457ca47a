"""The MoE feed-forward (model/moe.py) against a dense FFN of the same active FLOPs, forward + backward tokens/s,
for each compute backend, side by side (issue 21, item 7).

Per shape and routing: the dense FeedForward has d_ff = experts_per_token * moe_d_ff (+ the shared experts' width),
so both sides do the same matmul FLOPs per token (the router's E x d projection is on the MoE side only, as it is in
a model). Rounds alternate dense / each backend (the first round warms up); the median per side gives tokens/s and
the ratio MoE / dense. Each backend is timed twice: the whole layer (router, top-k, sort, gather, experts, weighted
scatter back) and its compute function alone on already-sorted tokens, so `layer_ms - compute_ms` is the
permutation's share. Routing "balanced" is the random router's; "skewed" adds a per-expert selection bias (the
layer's `expert_bias`) calibrated so the busiest expert gets ~`--skew` times the mean load. One JSON line per
(shape, routing). `--queue N` times N steps per side between synchronisations: the host runs ahead, as it does
between a model's layers, so the launch latency of each step's first kernels is no longer on the clock. `--compile
[MODE]` compiles both sides; `compiled_graphs` counts the graphs dynamo made (2: none broken).

    PYTHONPATH=$PWD python bench/moe_layer.py --device cpu --dtype fp32 --shape small cpu-512
    PYTHONPATH=$PWD python bench/moe_layer.py --device cuda --dtype bf16 --shape mixtral-reduced qwen3-moe
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal, cast

import torch
from tables import add_table_arguments, write_table

from meshformer.model.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig
from meshformer.model.init import init_weights
from meshformer.model.layers import FeedForward
from meshformer.model.moe import BACKENDS, COMPUTE, MoEFeedForward, grouped_mm_runs, route
from meshformer.parallel.kernels import compile_kwargs

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# name: (d_model, n_experts, experts_per_token, moe_d_ff, n_shared_experts, activation, tokens)
Activation = Literal["relu", "gelu", "gelu_tanh", "swiglu"]
SHAPES: dict[str, tuple[int, int, int, int, int, Activation, int]] = {
    "tiny": (32, 4, 2, 48, 0, "swiglu", 64),  # tests only
    "small": (128, 8, 2, 256, 0, "gelu", 2048),  # tiny-gpt's width with GELU experts, one batch of 16 x 128
    "cpu-512": (512, 8, 2, 1024, 0, "swiglu", 4096),  # realistic proportions at a CPU-sized width
    "cpu-fine": (512, 32, 4, 256, 1, "swiglu", 4096),  # fine-grained + a shared expert
    "mixtral-reduced": (4096, 8, 2, 7168, 0, "swiglu", 8192),  # Mixtral d 4096, 8 x top-2; width 14336 halved
    "qwen3-moe": (2048, 128, 8, 768, 0, "swiglu", 8192),  # Qwen3-30B-A3B's layer: 128 experts of 768, top-8
}


def configs(shape: str) -> tuple[ModelConfig, ModelConfig]:
    d, e, k, width, shared, act, _ = SHAPES[shape]
    moe = ModelConfig(vocab_size=128, d_model=d, n_layers=1, max_seq_len=16, bias=False,
                      attention=AttentionConfig(n_heads=max(1, d // 64)), ffn=FfnConfig(d_ff=width, activation=act),
                      moe=MoeConfig(n_experts=e, experts_per_token=k, d_ff=width, n_shared_experts=shared))
    dense = replace(moe, ffn=replace(moe.ffn, d_ff=(k + shared) * width),
                    moe=replace(moe.moe, n_experts=0, n_shared_experts=0, d_ff=0))
    return moe, dense


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def skew_bias(moe: MoEFeedForward, x: torch.Tensor, target: float) -> torch.Tensor:
    """A selection bias, a ramp over the experts, scaled by bisection until max/mean load reaches ~target."""
    cfg = moe.cfg
    with torch.no_grad():
        logits = moe.router(x)
        ramp = -torch.linspace(0, 1, cfg.moe.n_experts, device=x.device) * logits.softmax(-1).std()

        def ratio(scale: float) -> float:
            load = torch.bincount(route(logits, cfg.moe.experts_per_token, bias=scale * ramp).experts.reshape(-1),
                                  minlength=cfg.moe.n_experts).float()
            return (load.max() / load.mean()).item()

        lo, hi = 0.0, 1.0
        while ratio(hi) < target and hi < 1e4:
            hi *= 2
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    return hi * ramp


def backend_runs(backend: str, device: torch.device, dtype: torch.dtype, cfg: ModelConfig) -> str | None:
    """None when the backend can run here, else why not (torch._grouped_mm's CUDA kernel: sm90+, bf16, row strides
    a multiple of 16 bytes)."""
    if backend != "grouped_mm":
        return None
    if not grouped_mm_runs(device.type):
        return f"torch._grouped_mm does not run on {device.type} here"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return "torch._grouped_mm on CUDA takes bf16 only"
        if any(n * dtype.itemsize % 16 for n in (cfg.d_model, cfg.expert_d_ff)):
            return "d_model and moe_d_ff must be multiples of 16 bytes for torch._grouped_mm"
    return None


def measure(shape: str, routing: str, device: torch.device, dtype: torch.dtype, rounds: int, skew: float,
            backends: list[str], profile: bool = False, compile_mode: str | None = None, queue: int = 1) -> dict:
    moe_cfg, dense_cfg = configs(shape)
    tokens = SHAPES[shape][-1]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, moe_cfg.d_model, generator=g).to(device, dtype)
    grad = torch.randn(tokens, moe_cfg.d_model, generator=g).to(device, dtype)
    moe = MoEFeedForward(moe_cfg)
    init_weights(moe.named_parameters(), moe_cfg, 0)
    moe.to(device, dtype)
    dense = FeedForward(dense_cfg)
    init_weights(dense.named_parameters(), dense_cfg, 0)
    dense.to(device, dtype)
    if routing == "skewed":
        moe.router.expert_bias.copy_(skew_bias(moe, x.float(), skew))

    # the compute functions alone, on the tokens sorted as the layer sorts them
    with torch.no_grad():
        r = route(moe.router(x), moe_cfg.moe.experts_per_token, bias=moe.router.expert_bias)
        slots = r.experts.reshape(-1)
        counts = torch.bincount(slots, minlength=moe_cfg.moe.n_experts)
        xs = x[torch.argsort(slots, stable=True) // moe_cfg.moe.experts_per_token].detach()
    xs.requires_grad_()
    ex = moe.experts
    xin = x.detach().requires_grad_()

    def fwd_bwd(fn: Callable[[], torch.Tensor], g: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            for p in (*moe.parameters(), *dense.parameters(), xin, xs):
                p.grad = None  # each step writes its gradients afresh, as one micro-batch per step does
            fn().backward(g)
        return step

    # compiled: the layer's elementwise glue (routing, combine) fused by inductor, as `train.compile` runs it
    run_dense, run_moe = dense, moe
    if compile_mode is not None:
        run_dense, run_moe = (torch.compile(side, **compile_kwargs(compile_mode)) for side in (dense, moe))
    torch._dynamo.utils.counters.clear()
    sides: dict[str, Callable[[], None]] = {"dense": fwd_bwd(lambda: run_dense(xin), grad)}
    skipped: dict[str, str] = {}
    grad_slots = torch.randn(xs.shape, generator=g).to(device, dtype)
    for backend in backends:
        why = backend_runs(backend, device, dtype, moe_cfg)
        if why:
            skipped[backend] = why
            continue

        def layer_side(b: str = backend) -> torch.Tensor:
            # the layer's experts read their backend from here (set from moe_backend when built)
            ex.backend = cast(Literal["loop", "padded", "grouped_mm"], b)
            return run_moe(xin)

        def compute_side(b: str = backend) -> torch.Tensor:
            return COMPUTE[b](xs, counts, ex.gate_proj, ex.up_proj, ex.down_proj, ex.act)

        sides[f"layer:{backend}"] = fwd_bwd(layer_side, grad)
        sides[f"compute:{backend}"] = fwd_bwd(compute_side, grad_slots)

    times: dict[str, list[float]] = {name: [] for name in sides}
    for rnd in range(rounds + 1):
        for name, step in list(sides.items()):
            synchronize(device)
            start = time.perf_counter()
            try:
                for _ in range(queue if rnd else 1):  # queued: the host runs ahead, as between a model's layers
                    step()
                synchronize(device)
            except (RuntimeError, NotImplementedError) as err:
                if rnd or name == "dense":  # only a backend's first call may fail (e.g. a kernel this torch lacks)
                    raise
                skipped[name.split(":")[1]] = f"{type(err).__name__}: {str(err)[:300]}"
                for side in (f"layer:{name.split(':')[1]}", f"compute:{name.split(':')[1]}"):
                    sides.pop(side, None)
                    times.pop(side, None)
                continue
            if rnd:  # the first round warms up (allocator, kernels, autotuning)
                times[name].append((time.perf_counter() - start) / queue)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    dense_tps = tokens / ms["dense"] * 1e3
    record: dict = {
        "bench": "moe_layer", "shape": shape, "routing": routing, "device": device.type, "dtype": str(dtype)[6:],
        "d_model": moe_cfg.d_model, "n_experts": moe_cfg.moe.n_experts,
        "experts_per_token": moe_cfg.moe.experts_per_token, "moe_d_ff": moe_cfg.expert_d_ff,
        "n_shared_experts": moe_cfg.moe.n_shared_experts, "dense_d_ff": dense_cfg.ffn.d_ff,
        "tokens": tokens, "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2),
        "rounds": rounds, "queue": queue, "compiled": compile_mode or False,
        # graphs dynamo made of both sides (dense: 1): a graph break in the layer shows as more
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] if compile_mode else None,
        "max_over_mean_load": round((counts.max() / counts.float().mean()).item(), 3),
        "dense_ms": round(ms["dense"], 3), "dense_tokens_per_s": round(dense_tps, 1), "backends": {},
        "skipped": skipped,
    }
    for backend in backends:
        if backend in skipped:
            continue
        layer_ms, compute_ms = ms[f"layer:{backend}"], ms[f"compute:{backend}"]
        record["backends"][backend] = {
            "layer_ms": round(layer_ms, 3), "compute_ms": round(compute_ms, 3),
            "tokens_per_s": round(tokens / layer_ms * 1e3, 1), "ratio": round(ms["dense"] / layer_ms, 3),
            "compute_ratio": round(ms["dense"] / compute_ms, 3),
            "permute_share": round(max(0.0, layer_ms - compute_ms) / layer_ms, 3),
        }
    ran = record["backends"]
    if ran:
        best = max(ran, key=lambda b: ran[b]["ratio"])
        record |= {"best_backend": best, "best_ratio": ran[best]["ratio"]}
        if profile:
            record["profile"] = {side: top_kernels(sides[side], device) for side in ("dense", f"layer:{best}")}
    return record


def host_syncs(step: Callable[[], None]) -> list[str]:
    """Where one step makes the host wait for the GPU (torch's sync debug mode): each stalls the launch queue."""
    import traceback
    import warnings

    found: list[str] = []

    def note(message, *_args, **_kwargs) -> None:
        if "synchronizing" in str(message):
            here = [f for f in traceback.extract_stack() if "meshformer" in f.filename]
            found.append(f"{here[-1].filename.rsplit('/', 1)[-1]}:{here[-1].lineno}" if here else "outside meshformer")

    with warnings.catch_warnings():  # restores the filters and showwarning on leaving
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def top_kernels(step: Callable[[], None], device: torch.device, steps: int = 3, top: int = 20) -> dict:
    """Where one side's time goes: its `top` operators by self time on the device per step, and the device's busy
    time per step against the (profiled) wall time: the gap is the device waiting for the host; and on CUDA the
    places in meshformer that synchronise the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    syncs = host_syncs(step) if device.type == "cuda" else None
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    # kernels only (device events have no CPU-side children): the device's busy time per step
    busy = sum(e.self_device_time_total for e in averages if e.device_type.name == "CUDA") / 1e3 / steps
    events = sorted(averages, key=lambda e: getattr(e, attr), reverse=True)[:top]
    return {"wall_ms_profiled": round(wall_ms, 3), "device_busy_ms": round(busy, 3), "host_syncs": syncs,
            "top": [{"op": e.key[:80], "ms": round(getattr(e, attr) / 1e3 / steps, 3), "calls": e.count // steps}
                    for e in events]}


ACTIVATIONS = {"relu": "ReLU", "gelu": "GELU", "gelu_tanh": "GELU (tanh)", "swiglu": "SwiGLU"}


def shape_name(record: dict) -> str:
    act = ACTIVATIONS[SHAPES[record["shape"]][5]] if record["shape"] in SHAPES else ""
    shared = f" + {record['n_shared_experts']} shared" if record["n_shared_experts"] else ""
    return (f"{record['shape']}: d {record['d_model']}, {record['n_experts']} × {record['moe_d_ff']} {act} "
            f"top-{record['experts_per_token']}{shared}, {record['tokens']:,} tok")


def table_rows(records: list[dict]) -> list[list[str]]:
    """One row per (shape, routing): each backend's tokens/s and ratio to the dense FFN, fastest first and in bold,
    and the ratio of its compute function alone; a shape is described in full on its first row."""
    rows, described = [], set()
    for r in records:
        ran = sorted(r["backends"].items(), key=lambda item: item[1]["ratio"], reverse=True)
        ratios = [f"{b['ratio']:.2f}" for _, b in ran]
        if ratios:
            ratios[0] = f"**{ratios[0]}**"
        shape = r["shape"] if r["shape"] in described else shape_name(r)
        described.add(r["shape"])
        rows.append([shape, f"{r['routing']} ({r['max_over_mean_load']:.3g})", " / ".join(name for name, _ in ran),
                     " / ".join(f"{b['tokens_per_s']:,.0f}" for _, b in ran), f"{r['dense_tokens_per_s']:,.0f}",
                     " / ".join(ratios), " / ".join(f"{b['compute_ratio']:.2f}" for _, b in ran)])
    return rows


def write(path: Path, machine: str, records: list[dict], command: str) -> dict:
    first = records[0]
    device = "a CPU" if first["device"] == "cpu" else f"a {first['device'].upper()} device"
    return write_table(
        path, machine=machine, page="moe", title=f"MoE layer speed on {device}", command=command,
        setup="Forward + backward of one MoE layer against a dense FFN of the same active FLOPs (d_ff = "
              "experts_per_token × moe_d_ff), rounds alternating, median of "
              f"{first['rounds']} rounds, {first['dtype']}, {first['threads']} thread{'s' * (first['threads'] != 1)}"
              f"{', compiled' if first['compiled'] else ''}. \"compute\" is the backend's function alone on "
              "already-sorted tokens, so layer − compute is the routing and permutation.",
        columns=["shape", "routing (max/mean load)", "backend", "MoE tok/s", "dense tok/s", "ratio (layer)",
                 "ratio (compute alone)"],
        align=["l", "l", "l", "r", "r", "r", "r"], rows=table_rows(records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["small", "cpu-512"], choices=sorted(SHAPES))
    parser.add_argument("--routing", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    parser.add_argument("--backend", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skew", type=float, default=2.0, help="skewed routing's target max/mean expert load")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--compile", nargs="?", const="default", default=None,
                        choices=["default", "max-autotune-no-cudagraphs"],
                        help="time both sides compiled with torch.compile, in this mode (train.compile_mode's)")
    parser.add_argument("--queue", type=int, default=1,
                        help="steps per side between synchronisations (1: each step alone, its launch latency "
                             "exposed; more: the host runs ahead, as in a model's stack of layers)")
    parser.add_argument("--profile", action="store_true",
                        help="also record where the dense side's and the best backend's time goes (top operators)")
    add_table_arguments(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 runs as the trainer runs it
    records = []
    for shape in args.shape:
        for routing in args.routing:
            records.append(measure(shape, routing, device, DTYPES[args.dtype], args.rounds, args.skew, args.backend,
                                   args.profile, args.compile, args.queue))
            print(json.dumps(records[-1]), flush=True)
    if args.table:
        command = "python bench/moe_layer.py" + "".join(
            f" --{flag} {value}" for flag, value in (("rounds", args.rounds), ("threads", args.threads))
            if value is not None and (flag, value) != ("rounds", 5))
        write(args.table, args.machine, records, command)


if __name__ == "__main__":
    main()
