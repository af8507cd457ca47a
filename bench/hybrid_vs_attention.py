"""A Qwen3-Next-style hybrid stack (3 Gated DeltaNet blocks : 1 full-attention block) against a full-attention
stack of the same widths and depth, as the sequence grows: forward + backward tokens/s, the crossover length, the
time ratio per doubling of T, and the activations each keeps per token next to the planner's estimate.

Both stacks: tiny-qwen3-next's widths (d_model 128; gated attention with 4 heads of 32, 2 key/value heads, QK-norm,
RoPE on a quarter of each head; Gated DeltaNet with 4 value heads, 2 query/key heads, all 32 wide, chunks of 64), a
dense SwiGLU feed-forward of width 512 in every block, 4 blocks, batch 1, fp32, SDPA's CPU flash kernel. Timed:
the 4 blocks (`Transformer.decode` from given hidden states, no embedding or head), forward + backward, rounds
alternating hybrid, attention after a warm-up round (the longest T: `--long-rounds`, no warm-up); medians.

Memory: the bytes the blocks' autograd graph keeps for backward (saved-tensor hooks, each storage once, parameters
excluded) per token, against the planner's `block_saved` for the same blocks (planner/activations.py).

    python bench/hybrid_vs_attention.py [--seq 2048 8192 32768] [--rounds 3] [--long-rounds 1] [--threads 1]
                                        [--clock cpu|wall] [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402

from meshformer.config import Config, load_config  # noqa: E402

DENSE = ["model.moe.n_experts=0", 'model.mlp_types=["dense"]', "model.vocab_size=256",
         "model.attention.document_mask=false", "model.linear_attention.chunk_size=64"]
STACKS = {"hybrid": ['model.layer_types=["linear_attention", "linear_attention", "linear_attention", '
                     '"full_attention"]'],
          "attention": ['model.layer_types=["full_attention"]']}


def config(stack: str, seq: int) -> Config:
    return load_config(ROOT / "configs" / "tiny-qwen3-next.toml",
                       [*DENSE, *STACKS[stack], f"model.max_seq_len={seq}", f"data.seq_len={seq}",
                        "data.batch_size=1"])


def _models(seq: int) -> dict[str, Any]:
    from meshformer.model.transformer import Transformer

    models = {}
    for stack in STACKS:
        torch.manual_seed(0)
        models[stack] = Transformer(config(stack, seq).model)
    return models


def time_stacks(seq: int, rounds: int, warm_up: bool, clock: str = "cpu") -> dict[str, float]:
    """Median forward + backward seconds of each stack's blocks on (1, seq, d_model) hidden states; clock "cpu":
    this process's CPU time (with one thread, steady when other processes share the cores)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    models = _models(seq)
    d_model = next(iter(models.values())).cfg.d_model
    h = torch.randn(1, seq, d_model, requires_grad=True)
    grad = torch.randn(1, seq, d_model)
    ids = torch.zeros(1, seq, dtype=torch.long)
    times: dict[str, list[float]] = {stack: [] for stack in models}
    for r in range(rounds + int(warm_up)):
        for stack, model in models.items():
            model.zero_grad(set_to_none=True)
            start = now()
            model.decode(ids, h=h, final_norm=False).backward(grad)
            if r or not warm_up:
                times[stack].append(now() - start)
    return {stack: sorted(ts)[len(ts) // 2] for stack, ts in times.items()}


def _kept_bytes(model: Any, seq: int) -> float:
    """Bytes the blocks' autograd graph keeps for backward: each saved storage once, parameters excluded."""
    from meshformer.planner.measure import saved_activation_bytes

    h = torch.randn(1, seq, model.cfg.d_model, requires_grad=True)
    ids = torch.zeros(1, seq, dtype=torch.long)
    return float(saved_activation_bytes(model, lambda: model.decode(ids, h=h, final_norm=False)))


def saved_bytes(seq: int) -> dict[str, tuple[float, float]]:
    """{stack: (bytes its blocks' graph keeps, the planner's block_saved over the same blocks)}."""
    from meshformer.planner.activations import activation_shape, block_saved

    out = {}
    for stack, model in _models(seq).items():
        kept = _kept_bytes(model, seq)
        cfg = config(stack, seq)
        shape = activation_shape(cfg, 1, 1, False, device_type="cpu")
        planned = sum(block_saved(cfg.model, shape, index=i) for i in range(cfg.model.n_layers))
        out[stack] = (kept, planned)
    return out


def crossover(results: list[dict[str, Any]]) -> str:
    """The T where the hybrid's time ratio crosses 1, the log of the ratio interpolated linearly in log T between
    measured lengths."""
    points = [(math.log2(r["seq"]), math.log(r["hybrid_over_attention"])) for r in results]
    if all(y < 0 for _, y in points):
        return f"below {results[0]['seq']:,} (the hybrid is faster at every measured T)"
    if all(y >= 0 for _, y in points):
        return f"above {results[-1]['seq']:,} (attention is faster at every measured T)"
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if y0 * y1 <= 0 and y0 != y1:
            return f"about {2 ** (x0 - y0 * (x1 - x0) / (y1 - y0)):,.0f}"
    return "not monotone over the measured T"


def measure(seqs: list[int], rounds: int, long_rounds: int, clock: str) -> list[dict[str, Any]]:
    results = []
    for seq in seqs:
        longest = seq == max(seqs) and len(seqs) > 1
        seconds = time_stacks(seq, long_rounds if longest else rounds, warm_up=not longest, clock=clock)
        memory = saved_bytes(seq)
        results.append({"bench": "hybrid_vs_attention", "seq": seq,
                        "rounds": long_rounds if longest else rounds, "warm_up": not longest,
                        "hybrid_s": round(seconds["hybrid"], 3), "attention_s": round(seconds["attention"], 3),
                        "hybrid_tok_s": round(seq / seconds["hybrid"]),
                        "attention_tok_s": round(seq / seconds["attention"]),
                        "hybrid_over_attention": round(seconds["hybrid"] / seconds["attention"], 3),
                        **{f"{stack}_saved_bytes_per_token": round(kept / seq) for stack, (kept, _) in memory.items()},
                        **{f"{stack}_planned_bytes_per_token": round(plan / seq)
                           for stack, (_, plan) in memory.items()},
                        "threads": torch.get_num_threads(), "clock": clock,
                        "load_1min": round(os.getloadavg()[0], 2)})
        print(json.dumps(results[-1]), flush=True)
    return results


def slopes(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each stack's time ratio per doubling of T, over the measured range (geometric mean)."""
    first, last = results[0], results[-1]
    doublings = math.log2(last["seq"] / first["seq"])
    return {stack: (last[f"{stack}_s"] / first[f"{stack}_s"]) ** (1 / doublings) if doublings else float("nan")
            for stack in STACKS}


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]], str]:
    columns = ["T", "hybrid tok/s", "attention tok/s", "hybrid / attention time", "hybrid saved KiB/token "
               "(planner)", "attention saved KiB/token (planner)"]
    rows = [[f"{r['seq']:,}", f"{r['hybrid_tok_s']:,}", f"{r['attention_tok_s']:,}",
             f"{r['hybrid_over_attention']:.2f}",
             f"{r['hybrid_saved_bytes_per_token'] / 1024:.1f} ({r['hybrid_planned_bytes_per_token'] / 1024:.1f})",
             f"{r['attention_saved_bytes_per_token'] / 1024:.1f} ({r['attention_planned_bytes_per_token'] / 1024:.1f})"]
            for r in results]
    slope = slopes(results)
    notes = (f"Crossover (hybrid faster from): T {crossover(results)}. Time per doubling of T over "
             f"{results[0]['seq']:,}–{results[-1]['seq']:,}: hybrid × {slope['hybrid']:.2f}, attention × "
             f"{slope['attention']:.2f} (linear in T is × 2, quadratic × 4). Saved bytes: what the 4 blocks' autograd "
             "graph keeps for backward, measured with saved-tensor hooks (each storage once, parameters excluded), "
             "per token; in brackets the planner's `block_saved` for the same blocks.")
    return columns, rows, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-rounds", type=int, default=1, help="rounds at the longest T (no warm-up there)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", default="cpu", choices=["wall", "cpu"], help="cpu: this process's CPU time")
    add_table_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seqs = sorted(args.seq)
    results = measure(seqs, args.rounds, args.long_rounds, args.clock)
    columns, rows, notes = table(results)
    print(json.dumps({"bench": "hybrid_vs_attention_summary", "notes": notes}))
    if args.table:
        write_table(args.table, machine=args.machine, page="architectures",
                    title="Hybrid Gated DeltaNet : attention stack against full attention, by sequence length",
                    command=(f"python bench/hybrid_vs_attention.py --seq {' '.join(map(str, seqs))} --rounds "
                             f"{args.rounds} --long-rounds {args.long_rounds} --threads {args.threads} --clock "
                             f"{args.clock}"),
                    setup=("4 blocks at tiny-qwen3-next's widths (d_model 128; gated attention, 4 heads of 32, 2 "
                           "key/value heads; Gated DeltaNet, 4 value heads and 2 query/key heads of 32, chunks of 64), "
                           "a dense SwiGLU of width 512 in each block; hybrid = 3 Gated DeltaNet then 1 attention "
                           "block, attention = 4 attention blocks. Batch 1, fp32, forward + backward of the blocks "
                           f"only, {args.threads} thread(s), "
                           f"{'CPU' if args.clock == 'cpu' else 'wall'} time; medians of {args.rounds} alternating "
                           f"rounds after a warm-up ({args.long_rounds} "
                           f"without warm-up at T {seqs[-1]:,})."),
                    notes=notes, columns=columns, rows=rows, align=["r", "r", "r", "r", "r", "r"])


if __name__ == "__main__":
    main()
