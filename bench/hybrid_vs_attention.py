"""A hybrid stack (3 linear-time token-mixer blocks : 1 attention block) against an attention stack of the same
widths and depth, as the sequence grows: forward + backward tokens/s, the crossover length, the time ratio per
doubling of T, and the activations each keeps per token next to the planner's estimate. `--hybrid` picks the hybrid;
the attention stack is its attention block in all 4 places:

    qwen3-next     Gated DeltaNet : gated attention (the default; below)
    kimi-linear    Kimi Delta Attention : latent attention without RoPE (tiny-kimi-linear's widths)
    olmo-hybrid    Gated DeltaNet : OLMo 3 attention (olmo-hybrid-7b's blocks at d_model 128)
    nemotron-h     Mamba-2 : attention without positions (tiny-nemotron-h's widths)

Every stack has the same dense SwiGLU feed-forward of width 512 in each block, so the comparison is about the token
mixers; each table's setup states its widths. Qwen3-Next's: d_model 128; gated attention with 4 heads of 32, 2
key/value heads, QK-norm, RoPE on a quarter of each head; Gated DeltaNet with 4 value heads, 2 query/key heads, all 32
wide, chunks of 64. All: 4 blocks, batch 1, fp32, SDPA on CPU. Timed: the 4 blocks (`Transformer.decode` from given
hidden states, no embedding or head), forward + backward, rounds alternating hybrid, attention after a warm-up round
(the longest T: `--long-rounds`, no warm-up); medians.

Memory: the bytes the blocks' autograd graph keeps for backward (saved-tensor hooks, each storage once, parameters
excluded) per token, against the planner's `block_saved` for the same blocks (planner/activations.py).

    python bench/hybrid_vs_attention.py [--hybrid qwen3-next|kimi-linear|olmo-hybrid|nemotron-h]
                                        [--seq 2048 8192 32768] [--rounds 3] [--long-rounds 1] [--threads 1]
                                        [--clock cpu|wall] [--table PATH --machine TEXT]

Each hybrid's table: docs/benchmarks/data/architectures-03-hybrid-vs-attention.json (qwen3-next),
architectures-03-hybrid-vs-attention-<hybrid>.json (the others).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

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
FFN = ["model.ffn.d_ff=512", 'model.ffn.activation="swiglu"']


class Hybrid(NamedTuple):
    """One hybrid: its bundled config, the overrides that make its stacks (dense FFN, widths), each stack's
    layer_types, and the words of its table."""

    config: str
    overrides: list[str]
    stacks: dict[str, list[str]]
    title: str
    setup: str
    table: str  # the table's file under docs/benchmarks/data
    drop: dict[str, str] = {}  # {stack: a key whose line of the file that stack leaves out}  # noqa: RUF012
    note: str = ""  # what its table's readers need beyond the shared notes


def _pattern(linear: str, attention: str) -> dict[str, list[str]]:
    return {"hybrid": [f'model.layer_types=["{linear}", "{linear}", "{linear}", "{attention}"]'],
            "attention": [f'model.layer_types=["{attention}"]']}


HYBRIDS = {
    "qwen3-next": Hybrid(
        "tiny-qwen3-next.toml", DENSE, STACKS,
        "Hybrid Gated DeltaNet : attention stack against full attention, by sequence length",
        "4 blocks at tiny-qwen3-next's widths (d_model 128; gated attention, 4 heads of 32, 2 key/value heads; Gated "
        "DeltaNet, 4 value heads and 2 query/key heads of 32, chunks of 64), a dense SwiGLU of width 512 in each "
        "block; hybrid = 3 Gated DeltaNet then 1 attention block, attention = 4 attention blocks.",
        "architectures-03-hybrid-vs-attention.json"),
    "kimi-linear": Hybrid(
        "tiny-kimi-linear.toml",
        ["model.moe.n_experts=0", 'model.mlp_types=["dense"]', *FFN, "model.vocab_size=256",
         "model.attention.document_mask=false"],
        _pattern("kda", "mla"),
        "Hybrid Kimi Delta Attention : latent attention stack against latent attention, by sequence length",
        "4 blocks at tiny-kimi-linear's widths (d_model 128; Kimi Delta Attention, 4 heads of 32 with a forget gate "
        "per key channel, chunks of 16; latent attention without RoPE, 4 heads, a 32-wide latent, query/key 32 + 16, "
        "values 32), a dense SwiGLU of width 512 in each block; hybrid = 3 KDA then 1 latent-attention block, "
        "attention = 4 latent-attention blocks.",
        "architectures-03-hybrid-vs-attention-kimi-linear.json",
        note=("Latent attention's queries and keys (48 wide) are wider than its values (32), which SDPA's CPU flash "
              "kernel does not take: on CPU it runs SDPA's math path, which keeps each head's T × T fp32 "
              "probabilities for backward (16 bytes per token per token of T per block, the growth of the saved "
              "column with T), and which the planner's `block_saved` does not count.")),
    "olmo-hybrid": Hybrid(
        "olmo-hybrid-7b.toml",
        ["model.d_model=128", "model.n_layers=4", "model.vocab_size=256", "model.attention.n_heads=4",
         "model.linear_attention.n_heads=4", "model.linear_attention.key_head_dim=32",
         "model.linear_attention.value_head_dim=64", "model.linear_attention.chunk_size=64", *FFN,
         "model.attention.document_mask=false", 'train.dtype="fp32"'],
        _pattern("linear_attention", "full_attention"),
        "Hybrid OLMo Gated DeltaNet : attention stack against full attention, by sequence length",
        "4 of olmo-hybrid-7b's blocks at d_model 128 (OLMo 3 attention, 4 heads of 32, QK-norm over the projections, "
        "each sub-layer's output normalised, no positions; Gated DeltaNet, 4 query/key heads of 32 and 4 value heads "
        "of 64, separate projections, negative eigenvalues allowed, chunks of 64), a dense SwiGLU of width 512 in "
        "each block; hybrid = 3 Gated DeltaNet then 1 attention block, attention = 4 attention blocks.",
        "architectures-03-hybrid-vs-attention-olmo-hybrid.json",
        # the attention stack has no Gated DeltaNet block for the file's pre-norm by kind to name
        drop={"attention": "by_kind"}),
    "nemotron-h": Hybrid(
        "tiny-nemotron-h.toml",
        ["model.n_layers=4", "model.moe.n_experts=0", 'model.mlp_types=["dense"]', *FFN, "model.vocab_size=256",
         "model.attention.document_mask=false", "model.mamba.chunk_size=64"],
        _pattern("mamba2", "full_attention"),
        "Hybrid Mamba-2 : attention stack against full attention, by sequence length",
        "4 blocks at tiny-nemotron-h's widths (d_model 128; Mamba-2, 4 heads of 64, state 16, 2 groups, chunks of "
        "64; attention without positions, 4 heads of 32, 2 key/value heads), each block a token mixer and the same "
        "dense SwiGLU of width 512 (not Nemotron-H's one mixer per layer), so only the token mixers differ; hybrid = "
        "3 Mamba-2 then 1 attention block, attention = 4 attention blocks.",
        "architectures-03-hybrid-vs-attention-nemotron-h.json"),
}


def config(stack: str, seq: int, hybrid: str = "qwen3-next") -> Config:
    spec = HYBRIDS[hybrid]
    path = ROOT / "configs" / spec.config
    overrides = [*spec.overrides, *spec.stacks[stack], f"model.max_seq_len={seq}", f"data.seq_len={seq}",
                 "data.batch_size=1"]
    if stack not in spec.drop:
        return load_config(path, overrides)
    lines = [line for line in path.read_text().splitlines() if not line.startswith(f"{spec.drop[stack]} =")]
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / spec.config
        copy.write_text("\n".join(lines) + "\n")
        return load_config(copy, overrides)


def _models(seq: int, hybrid: str = "qwen3-next") -> dict[str, Any]:
    from meshformer.model.transformer import Transformer

    models = {}
    for stack in STACKS:
        torch.manual_seed(0)
        models[stack] = Transformer(config(stack, seq, hybrid).model)
    return models


def time_stacks(seq: int, rounds: int, warm_up: bool, clock: str = "cpu", hybrid: str = "qwen3-next"
                ) -> dict[str, float]:
    """Median forward + backward seconds of each stack's blocks on (1, seq, d_model) hidden states; clock "cpu":
    this process's CPU time (with one thread, steady when other processes share the cores)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    models = _models(seq, hybrid)
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


def saved_bytes(seq: int, hybrid: str = "qwen3-next") -> dict[str, tuple[float, float | None]]:
    """{stack: (bytes its blocks' graph keeps, the planner's block_saved over the same blocks, None where the
    planner has no bytes for a block's kind)}."""
    from meshformer.planner.activations import activation_shape, block_saved

    out: dict[str, tuple[float, float | None]] = {}
    for stack, model in _models(seq, hybrid).items():
        kept = _kept_bytes(model, seq)
        cfg = config(stack, seq, hybrid)
        shape = activation_shape(cfg, 1, 1, False, device_type="cpu")
        planned: float | None
        try:
            planned = sum(block_saved(cfg.model, shape, index=i) for i in range(cfg.model.n_layers))
        except NotImplementedError:  # a kind that declares no saved bytes (components/base.py)
            planned = None
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


def measure(seqs: list[int], rounds: int, long_rounds: int, clock: str, hybrid: str = "qwen3-next"
            ) -> list[dict[str, Any]]:
    results = []
    for seq in seqs:
        longest = seq == max(seqs) and len(seqs) > 1
        seconds = time_stacks(seq, long_rounds if longest else rounds, warm_up=not longest, clock=clock,
                              hybrid=hybrid)
        memory = saved_bytes(seq, hybrid)
        named = {} if hybrid == "qwen3-next" else {"hybrid": hybrid}
        results.append({"bench": "hybrid_vs_attention", **named, "seq": seq,
                        "rounds": long_rounds if longest else rounds, "warm_up": not longest,
                        "hybrid_s": round(seconds["hybrid"], 3), "attention_s": round(seconds["attention"], 3),
                        "hybrid_tok_s": round(seq / seconds["hybrid"]),
                        "attention_tok_s": round(seq / seconds["attention"]),
                        "hybrid_over_attention": round(seconds["hybrid"] / seconds["attention"], 3),
                        **{f"{stack}_saved_bytes_per_token": round(kept / seq) for stack, (kept, _) in memory.items()},
                        **{f"{stack}_planned_bytes_per_token": None if plan is None else round(plan / seq)
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


def _kib(r: dict[str, Any], stack: str) -> str:
    planned = r[f"{stack}_planned_bytes_per_token"]
    plan = "planner: no bytes for its kinds" if planned is None else f"{planned / 1024:.1f}"
    return f"{r[f'{stack}_saved_bytes_per_token'] / 1024:.1f} ({plan})"


def table(results: list[dict[str, Any]], note: str = "") -> tuple[list[str], list[list[Any]], str]:
    columns = ["T", "hybrid tok/s", "attention tok/s", "hybrid / attention time", "hybrid saved KiB/token "
               "(planner)", "attention saved KiB/token (planner)"]
    rows = [[f"{r['seq']:,}", f"{r['hybrid_tok_s']:,}", f"{r['attention_tok_s']:,}",
             f"{r['hybrid_over_attention']:.2f}",
             _kib(r, "hybrid"), _kib(r, "attention")]
            for r in results]
    slope = slopes(results)
    notes = (f"Crossover (hybrid faster from): T {crossover(results)}. Time per doubling of T over "
             f"{results[0]['seq']:,}–{results[-1]['seq']:,}: hybrid × {slope['hybrid']:.2f}, attention × "
             f"{slope['attention']:.2f} (linear in T is × 2, quadratic × 4). Saved bytes: what the 4 blocks' autograd "
             "graph keeps for backward, measured with saved-tensor hooks (each storage once, parameters excluded), "
             "per token; in brackets the planner's `block_saved` for the same blocks.")
    return columns, rows, f"{notes} {note}" if note else notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hybrid", default="qwen3-next", choices=list(HYBRIDS),
                        help="the hybrid measured against its attention stack")
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-rounds", type=int, default=1, help="rounds at the longest T (no warm-up there)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", default="cpu", choices=["wall", "cpu"], help="cpu: this process's CPU time")
    add_table_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seqs = sorted(args.seq)
    spec = HYBRIDS[args.hybrid]
    results = measure(seqs, args.rounds, args.long_rounds, args.clock, args.hybrid)
    columns, rows, notes = table(results, spec.note)
    print(json.dumps({"bench": "hybrid_vs_attention_summary", "notes": notes}))
    if args.table:
        which = "" if args.hybrid == "qwen3-next" else f"--hybrid {args.hybrid} "
        write_table(args.table, machine=args.machine, page="architectures", title=spec.title,
                    command=(f"python bench/hybrid_vs_attention.py {which}--seq {' '.join(map(str, seqs))} --rounds "
                             f"{args.rounds} --long-rounds {args.long_rounds} --threads {args.threads} --clock "
                             f"{args.clock}"),
                    setup=(f"{spec.setup} Batch 1, fp32, forward + backward of the blocks "
                           f"only, {args.threads} thread(s), "
                           f"{'CPU' if args.clock == 'cpu' else 'wall'} time; medians of {args.rounds} alternating "
                           f"rounds after a warm-up ({args.long_rounds} "
                           f"without warm-up at T {seqs[-1]:,})."),
                    notes=notes, columns=columns, rows=rows, align=["r", "r", "r", "r", "r", "r"])


if __name__ == "__main__":
    main()
