"""FP8 (torchao float8, tensorwise / rowwise) against bf16 at a Llama-3-8B layer shape, side by side in one run.

Each recipe trains the same model (same seed, same real-text batches from memory) for `--steps` steps with
`Trainer.train_step`; prints one JSON line per recipe as soon as it finishes: tokens/s over the last steps,
speed-up over bf16, mean loss over the last 10 steps and its relative difference from bf16. A recipe may add
`+ends` (train.fp8_keep_ends: first and last block in bf16) and `@seedN` (another initialisation): `off@seed1`
is the noise floor, the loss difference bf16 itself shows from a different seed.

    python bench/fp8_layers.py --steps 200 [--recipes off off@seed1 tensorwise tensorwise+ends rowwise]
    python bench/fp8_layers.py --shape tiny-llama --steps 5 --device cpu --emulate   # CPU dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_common import MemoryBatches, bench_config, corpus_tokens, emit, peak_memory_gib, reset_memory, sync

import meshformer.parallel.float8 as float8
from meshformer.model.flops import flops_per_token
from meshformer.train.trainer import Trainer


def recipe_config(recipe: str, args):
    """'tensorwise+ends@seed1' -> the run config (fp8 recipe, keep_ends, seed)."""
    name, _, seed = recipe.partition("@seed")
    fp8, *flags = name.split("+")
    if fp8 not in ("off", *float8.FP8_RECIPES) or set(flags) - {"ends"} or (seed and not seed.isdigit()):
        raise SystemExit(f"bad recipe {recipe!r}: off | tensorwise | rowwise, optionally +ends and @seedN")
    extra = [*(["train.fp8_keep_ends=true"] if "ends" in flags else []), *([f"train.seed={seed}"] if seed else [])]
    return bench_config(args.shape, dtype="bf16", device=args.device, compile=args.compile, fp8=fp8,
                        batch=args.batch, extra=extra)


def run(recipe: str, tokens: torch.Tensor | None, args) -> tuple[dict, torch.Tensor]:
    cfg = recipe_config(recipe, args)
    reset_memory(torch.device(args.device))
    trainer = Trainer(cfg)
    if tokens is None:
        tokens = corpus_tokens(trainer)
    trainer.train_iter = MemoryBatches(tokens, cfg.data.batch_size, cfg.data.seq_len, seed=1)
    losses, timed_from = [], max(args.steps // 4, min(args.steps - 1, 3))
    start = time.perf_counter()
    for i in range(args.steps):
        if i == timed_from:
            sync(trainer.device)
            t0 = time.perf_counter()
        stats = trainer.train_step()
        losses.append(stats.loss_sum / stats.global_tokens)
    sync(trainer.device)
    elapsed = time.perf_counter() - t0
    per_step = cfg.data.batch_size * cfg.data.seq_len
    tps = per_step * (args.steps - timed_from) / elapsed
    last = torch.stack(losses[-10:]).float().mean().item()
    record = {"bench": "fp8_layers", "shape": args.shape, "recipe": recipe, "compile": args.compile,
              "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "cpu",
              "steps": args.steps, "tokens_per_s": round(tps, 1),
              "mfu": round(flops_per_token(cfg.model, cfg.data.seq_len) * tps / trainer.ceiling.flops, 4),
              "loss_last10": round(last, 5), "fp8": trainer.parallel_model.report.get("fp8"),
              "peak_memory_gib": peak_memory_gib(trainer.device), "wall_s": round(time.perf_counter() - start, 1)}
    del trainer
    reset_memory(torch.device(args.device))
    return record, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama8b-layers")
    parser.add_argument("--recipes", nargs="+", default=["off", "tensorwise", "rowwise"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--compile", default="blocks", choices=["off", "blocks", "model"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--emulate", action="store_true", help="CPU dry run: torchao's emulated float8 matmuls")
    args = parser.parse_args()
    if args.emulate:  # let the hardware check pass; apply_float8 emulates off CUDA
        float8.fp8_supported = lambda device: True
    for recipe in args.recipes:  # refuse a typo before any work
        recipe_config(recipe, args)
    tokens, baseline = None, None
    for recipe in args.recipes:
        record, tokens = run(recipe, tokens, args)
        if recipe == "off":
            baseline = record
        elif baseline is not None:
            record["speedup_vs_bf16"] = round(record["tokens_per_s"] / baseline["tokens_per_s"], 3)
            record["loss_rel_diff_vs_bf16"] = round(abs(record["loss_last10"] / baseline["loss_last10"] - 1), 5)
        emit(record)


if __name__ == "__main__":
    main()
