"""Our `Trainer.train_step` against a nanoGPT-style reference (bench/nanogpt_ref.py), side by side in one run.

Same shape, seed, optimizer settings (AdamW lr 6e-4, betas 0.9/0.95, decay 0.1 on matrices, clip 1.0) and
in-memory data for both; FLOPs/token = 6N + 12·L·d·T for both. On CPU the two alternate round by round so
machine noise hits both alike, each in a process of its own by default (as two programs would run: neither
inherits the other's allocator settings, thread pool or caches); on CUDA (large shapes: two models would not
fit together) each side runs its rounds in turn, synchronised. Prints one JSON line per (shape, dtype, compile):

    python bench/vs_nanogpt.py --shape S M G --dtype fp32 bf16 [--compile off] [--steps 10] [--rounds 3]
    python bench/vs_nanogpt.py --shape S --threads 1 --clock cpu   # a loaded machine: CPU time of one thread
    python bench/vs_nanogpt.py --shape llama-1b --dtype bf16 --compile blocks --reference none   # ours only
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanogpt_ref import GPTShape, ReferenceStep
from step_common import (
    GPT_SHAPES,
    MemoryBatches,
    bench_config,
    emit,
    peak_memory_gib,
    random_tokens,
    reset_memory,
    timed,
)
from tables import add_table_arguments, write_row

from meshformer.model.flops import flops_per_token
from meshformer.train.trainer import Trainer


class Ours:
    def __init__(self, cfg, tokens: torch.Tensor) -> None:
        self.trainer = Trainer(cfg)
        self.trainer.train_iter = MemoryBatches(tokens, cfg.data.batch_size, cfg.data.seq_len)
        self.trainer.state.step = 0

    def __call__(self) -> None:
        self.trainer.train_step()


class Reference:
    def __init__(self, cfg, tokens: torch.Tensor, device: torch.device, compile: bool) -> None:
        m = cfg.model
        torch.manual_seed(cfg.train.seed)
        shape = GPTShape(m.n_layers, m.attention.n_heads, m.d_model, cfg.data.seq_len, m.vocab_size)
        self.step = ReferenceStep(shape, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay, grad_clip=cfg.optim.grad_clip,
                                  dtype=torch.bfloat16 if cfg.train.dtype == "bf16" else None, device=device,
                                  compile=compile)
        self.batches = MemoryBatches(tokens, cfg.data.batch_size, cfg.data.seq_len)

    def __call__(self) -> None:
        self.step(*self.batches.xy())


def warm(fn, steps: int, device: torch.device) -> float:
    """Warm-up (compilation happens here); returns its wall seconds."""
    return timed(fn, steps, device) * steps


def make(side: str, cfg, tokens: torch.Tensor, device: torch.device, compile: str):
    reset_memory(device)
    if side == "ours":
        return Ours(cfg, tokens)
    return Reference(cfg, tokens, device, compile != "off")


def serve_side(conn, side: str, cfg, device: torch.device, compile: str, args) -> None:
    """One side in its own process: build, warm up, report; then time a round per request until told to stop."""
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = make(side, cfg, random_tokens(cfg.model.vocab_size, device), device, compile)
    warmup = warm(runner, args.warmup, device)
    conn.send((warmup, runner.trainer.ceiling.flops if side == "ours" else None))
    while conn.recv():
        conn.send(timed(runner, args.steps, device, args.clock))


def alternate_in_processes(sides: list[str], cfg, device: torch.device, compile: str, args):
    """CPU: each side in a process of its own (its own allocator state, thread pool and compile caches, as
    two separate programs would have), timed round by round in turn, so machine noise hits both alike."""
    context = mp.get_context("spawn")
    conns, procs, warmup_s, times = {}, [], {}, {side: [] for side in sides}
    peak_flops = None
    for side in sides:  # one after the other: a side's set-up (our FLOP-ceiling probe) runs undisturbed
        conns[side], child = context.Pipe()
        procs.append(context.Process(target=serve_side, args=(child, side, cfg, device, compile, args), daemon=True))
        procs[-1].start()
        try:
            warmup_s[side], peak = conns[side].recv()
        except EOFError:
            raise SystemExit(f"the {side} side's process died while building or warming up (exit code "
                             f"{procs[-1].exitcode}); run with --isolate none to see its traceback here") from None
        peak_flops = peak_flops or peak
    for _ in range(args.rounds):
        for side in sides:
            conns[side].send(True)
            times[side].append(conns[side].recv())
    for side in sides:
        conns[side].send(False)
    for proc in procs:
        proc.join()
    return times, warmup_s, peak_flops


def alternate_in_process(sides: list[str], cfg, tokens: torch.Tensor, device: torch.device, compile: str, args):
    """CPU, --isolate none: both sides in this process (sharing its allocator and threads), alternating rounds."""
    runners = {side: make(side, cfg, tokens, device, compile) for side in sides}
    warmup_s = {side: warm(runners[side], args.warmup, device) for side in sides}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in sides:
            times[side].append(timed(runners[side], args.steps, device, args.clock))
    return times, warmup_s, runners["ours"].trainer.ceiling.flops


def one_side_at_a_time(sides: list[str], cfg, tokens: torch.Tensor, device: torch.device, compile: str, args):
    """CUDA (two large models would not fit together): build, warm up, time its rounds and free, side by side."""
    times, warmup_s, memory, peak_flops = {}, {}, {}, None
    for side in sides:
        runner = make(side, cfg, tokens, device, compile)
        warmup_s[side] = warm(runner, args.warmup, device)
        times[side] = [timed(runner, args.steps, device, args.clock) for _ in range(args.rounds)]
        memory[side] = peak_memory_gib(device)
        if side == "ours":
            peak_flops = runner.trainer.ceiling.flops
        del runner
        reset_memory(device)
    return times, warmup_s, memory, peak_flops


def run(shape: str, dtype: str, compile: str, loss: str, args) -> dict:
    cfg = bench_config(shape, dtype=dtype, device=args.device, compile=compile, loss=loss, batch=args.batch)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    with_ref = args.reference == "nanogpt" and shape in GPT_SHAPES
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    sides = ["reference", "ours"] if with_ref else ["ours"]
    memory: dict[str, float | None] = {}
    if device.type == "cpu" and args.isolate == "process":
        times, warmup_s, peak_flops = alternate_in_processes(sides, cfg, device, compile, args)
    elif device.type == "cpu":
        tokens = random_tokens(cfg.model.vocab_size, device)
        times, warmup_s, peak_flops = alternate_in_process(sides, cfg, tokens, device, compile, args)
    else:
        tokens = random_tokens(cfg.model.vocab_size, device)
        times, warmup_s, memory, peak_flops = one_side_at_a_time(sides, cfg, tokens, device, compile, args)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    record = {"bench": "vs_nanogpt", "shape": shape, "dtype": dtype, "compile": compile, "loss": loss,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "clock": args.clock,
              "isolate": args.isolate if device.type == "cpu" else "none", "load_1min": round(os.getloadavg()[0], 2),
              "batch": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
              "flops_per_token": fpt, "peak_flops": peak_flops, "torch": torch.__version__}
    for side in sides:
        tps = tokens_per_step / statistics.median(times[side])
        record[f"{side}_tokens_per_s"] = round(tps, 1)
        record[f"{side}_rounds_tokens_per_s"] = [round(tokens_per_step / t) for t in times[side]]
        record[f"{side}_mfu"] = round(fpt * tps / peak_flops, 4) if peak_flops else None
        record[f"{side}_warmup_s"] = round(warmup_s[side], 2)
        if memory.get(side) is not None:
            record[f"{side}_peak_memory_gib"] = round(memory[side], 2)
    if with_ref:
        record["ratio"] = round(record["ours_tokens_per_s"] / record["reference_tokens_per_s"], 3)
    return record


SUMMARY = ["`bench/vs_nanogpt.py`", "`Trainer.train_step` vs a compact nanoGPT-style step (bench/nanogpt_ref.py), "
           "each side in its own process on CPU, rounds alternating"]


def table_row(records: list[dict]) -> list[str]:
    """training-01-cpu.json's row: our tokens/s over the reference's per dtype and shape."""
    by_dtype: dict[str, list[str]] = {}
    for r in records:
        variant = "".join(f" {v}" for v in (r["compile"], r["loss"]) if v not in ("off", "auto"))
        by_dtype.setdefault(r["dtype"] + variant, []).append(f"{r['shape']} {r['ratio']:.2f}×")
    threads = records[0]["threads"]
    sides = "; ".join(f"{dtype} {', '.join(cells)}" for dtype, cells in by_dtype.items())
    return [*SUMMARY, f"{threads} thread{'s' * (threads != 1)}: {sides}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["S", "M", "G"])
    parser.add_argument("--dtype", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--compile", nargs="+", default=["off"], choices=["off", "blocks", "model"])
    parser.add_argument("--loss", nargs="+", default=["auto"], choices=["auto", "plain", "chunked", "liger"])
    parser.add_argument("--reference", default="nanogpt", choices=["nanogpt", "none"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=None, help="override the shape's batch size")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    add_table_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--isolate", default="process", choices=["process", "none"],
                        help="CPU: each side in its own process (default), or both in this one (sharing its "
                             "allocator settings and thread pool)")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: process CPU time (CPU device; use with --threads 1 on a loaded machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.device not in ("auto", "cpu"):
        raise SystemExit("--clock cpu measures CPU steps; use --device cpu (or auto on a machine without CUDA)")
    records = []
    for shape in args.shape:
        for dtype in args.dtype:
            for compile in args.compile:
                for loss in args.loss:
                    start = time.perf_counter()
                    record = run(shape, dtype, compile, loss, args)
                    record["wall_s"] = round(time.perf_counter() - start, 1)
                    emit(record)
                    records.append(record)
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row([r for r in records if "ratio" in r]))


if __name__ == "__main__":
    main()
