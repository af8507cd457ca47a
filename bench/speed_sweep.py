"""Step-speed candidates side by side in one process: each variant of our `Trainer.train_step` against one
measurement of the nanoGPT-style reference (compiled whole-model when any variant compiles), or MFU only.

A variant is tokens joined by "+": compile `off` | `blocks` | `model`; loss `plain` | `chunked` | `liger` (default
`auto`); attention kernel first `flash` | `cudnn` | `efficient`; `autotune` (inductor max-autotune without CUDA
graphs); FP8 recipe `tensorwise` | `rowwise` (torchao float8; bf16 otherwise, so an FP8 ratio against the bf16
reference is a different precision, named in its variant); `clippass` clips the gradients in a pass of their own
instead of inside the fused AdamW update (the step before the fold, to measure what it saves). The reference is
measured once, first; each variant then prints one JSON line as soon as it is done (a failing variant prints its
error and the sweep goes on):

    python bench/speed_sweep.py --shape gpt2-xl --variants blocks blocks+plain model+plain blocks+cudnn+plain
    python bench/speed_sweep.py --shape llama-1b --reference none --variants blocks+plain blocks+cudnn+plain
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_common import GPT_SHAPES, bench_config, emit, peak_memory_gib, random_tokens, reset_memory, timed
from vs_nanogpt import Ours, Reference

import meshformer.parallel.float8 as float8
from meshformer.model.flops import flops_per_token

COMPILE = ("off", "blocks", "model")
LOSS = ("auto", "plain", "chunked", "liger")
ATTENTION = ("sdpa", "flash", "cudnn", "efficient")


def parse_variant(name: str) -> tuple[str, str, list[str]]:
    """'blocks+cudnn+plain' -> (compile, loss, config overrides)."""
    compile, loss, extra = "off", "auto", []
    for token in name.split("+"):
        if token in COMPILE:
            compile = token
        elif token in LOSS:
            loss = token
        elif token in ATTENTION:
            extra.append(f"model.attention.backend={token}")
        elif token == "autotune":
            extra.append("train.compile_mode=max-autotune-no-cudagraphs")
        elif token in float8.FP8_RECIPES:
            extra.append(f"train.fp8={token}")
        elif token == "clippass":
            pass  # applied to the built trainer: see clip_in_own_pass
        else:
            raise SystemExit(f"unknown variant token {token!r} in {name!r}; "
                             f"use {COMPILE} {LOSS} {ATTENTION} {float8.FP8_RECIPES} autotune clippass")
    return compile, loss, extra


def clip_in_own_pass(trainer) -> None:
    """Clip without handing the factor to the optimizer: one more read and write of every gradient."""
    trainer.training_step.clip_in_update = False


def measure(runner, args, device: torch.device) -> dict:
    start = time.perf_counter()
    warm = timed(runner, args.warmup, device) * args.warmup  # compilation happens here
    rounds = [timed(runner, args.steps, device) for _ in range(args.rounds)]
    return {"seconds_per_step": statistics.median(rounds), "rounds": rounds, "warmup_s": warm,
            "peak_memory_gib": peak_memory_gib(device), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2-xl")
    parser.add_argument("--variants", nargs="+", default=["blocks", "model"])
    parser.add_argument("--reference", default="nanogpt", choices=["nanogpt", "none"])
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--emulate", action="store_true", help="CPU dry run of FP8 variants: torchao's emulation")
    args = parser.parse_args()
    if args.emulate:  # let the hardware check pass; apply_float8 emulates off CUDA
        float8.fp8_supported = lambda device: True
    variants = [(name, *parse_variant(name)) for name in args.variants]  # refuse a typo before any work
    device_name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device_name)
    base_cfg = bench_config(args.shape, dtype=args.dtype, device=device_name, batch=args.batch)
    tokens = random_tokens(base_cfg.model.vocab_size, device)
    tokens_per_step = base_cfg.data.batch_size * base_cfg.data.seq_len
    fpt = flops_per_token(base_cfg.model, base_cfg.data.seq_len)
    common = {"bench": "speed_sweep", "shape": args.shape, "dtype": args.dtype, "batch": base_cfg.data.batch_size,
              "seq_len": base_cfg.data.seq_len, "flops_per_token": fpt, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    reference_tps = None
    if args.reference == "nanogpt" and args.shape in GPT_SHAPES:
        compiled = any(compile != "off" for _, compile, _, _ in variants)
        reset_memory(device)
        ref = measure(Reference(base_cfg, tokens, device, compiled), args, device)
        reference_tps = tokens_per_step / ref["seconds_per_step"]
        emit({**common, "variant": "reference", "compile": "model" if compiled else "off",
              "tokens_per_s": round(reference_tps, 1), "warmup_s": round(ref["warmup_s"], 1),
              "peak_memory_gib": ref["peak_memory_gib"], "wall_s": round(ref["wall_s"], 1)})
        reset_memory(device)
    for name, compile, loss, extra in variants:
        record = {**common, "variant": name}
        try:
            cfg = bench_config(args.shape, dtype=args.dtype, device=device_name, compile=compile, loss=loss,
                               batch=args.batch, extra=extra)
            reset_memory(device)
            ours = Ours(cfg, tokens)
            if "clippass" in name.split("+"):
                clip_in_own_pass(ours.trainer)
            result = measure(ours, args, device)
            tps = tokens_per_step / result["seconds_per_step"]
            peak = ours.trainer.ceiling.flops
            record |= {"tokens_per_s": round(tps, 1),
                       "rounds_tokens_per_s": [round(tokens_per_step / t) for t in result["rounds"]],
                       "mfu": round(fpt * tps / peak, 4) if peak else None, "peak_flops": peak,
                       "ratio_vs_reference": round(tps / reference_tps, 3) if reference_tps else None,
                       "warmup_s": round(result["warmup_s"], 1), "peak_memory_gib": result["peak_memory_gib"],
                       "kernels": ours.trainer.parallel_model.report, "wall_s": round(result["wall_s"], 1)}
            del ours
        except Exception as err:  # one failing candidate must not hide the others' numbers
            record |= {"error": f"{type(err).__name__}: {err}"[:500]}
            traceback.print_exc()
        reset_memory(device)
        emit(record)


if __name__ == "__main__":
    main()
