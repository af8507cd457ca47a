"""DeepSeek Sparse Attention (kind `dsa`) against the dense multi-head latent attention it contains (kind `mla`), as
the sequence grows: forward + backward of one attention module in training mode (the indexer's loss included).

Both at DeepSeek-V3.2's proportions scaled to d_model 512 (8 heads; per head 64 position-free, 32 rotary, 64 value
columns; latents of 256 for keys and values, 192 for queries), the same weights; the indexer has 8 heads of width 32
and keeps TOPK keys per query. Input (1, T, d_model) fp32; rounds alternate MLA, DSA after a warm-up round; the
medians and their ratio are reported, with each kind's declared forward FLOPs.

    python bench/dsa_vs_mla.py [--seq 512 1024 2048] [--rounds 3] [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402

from meshformer.config import load_config  # noqa: E402
from meshformer.model.components import token_mixer  # noqa: E402
from meshformer.model.config import ModelConfig  # noqa: E402
from meshformer.model.masks import AttentionMask  # noqa: E402
from meshformer.model.positions import RotaryEmbedding  # noqa: E402

TOPK = 256
SMALL = ["model.d_model=512", "model.n_layers=1", 'model.mlp_types=["dense"]', "model.attention.n_heads=8",
         "model.mla.q_lora_rank=192", "model.mla.kv_lora_rank=256", "model.mla.qk_nope_head_dim=64",
         "model.mla.qk_rope_head_dim=32", "model.mla.v_head_dim=64", "model.max_seq_len=8192",
         "model.moe.n_experts=0", "model.mtp.depth=0", "model.dsa.n_heads=8", "model.dsa.head_dim=32",
         f"model.dsa.topk={TOPK}"]


def configs() -> tuple[ModelConfig, ModelConfig]:
    """(dsa, mla): the same model but for the token mixer."""
    dsa = load_config(ROOT / "configs" / "deepseek-v3.2.toml", SMALL).model
    return dsa, dataclasses.replace(dsa, layer_types=["mla"])


def forward_flops(cfg: ModelConfig, seq: int) -> int:
    return token_mixer(cfg, 0).flops(cfg, seq, seq, causal=True)


def time_pair(dsa: ModelConfig, mla: ModelConfig, seq: int, rounds: int) -> dict[str, float]:
    """Median forward + backward seconds of each module on (1, seq, d_model), rounds alternating."""
    torch.manual_seed(0)
    sparse = token_mixer(dsa, 0).build(dsa, causal=True).train()
    dense = token_mixer(mla, 0).build(mla, causal=True).train()
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    sides = {"mla": dense, "dsa": sparse}
    x = torch.randn(1, seq, dsa.d_model, requires_grad=True)
    grad = torch.randn(1, seq, dsa.d_model)
    mask = AttentionMask(None, is_causal=True)
    rope = RotaryEmbedding(dsa.rope_dim, seq)(torch.arange(seq))
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds + 1):
        for name, module in sides.items():
            module.zero_grad(set_to_none=True)
            x.grad = None
            start = time.perf_counter()
            module(x, mask, rope=rope).backward(grad)
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def timing_rows(seqs: list[int], rounds: int) -> list[dict[str, Any]]:
    dsa, mla = configs()
    results = []
    for seq in seqs:
        seconds = time_pair(dsa, mla, seq, rounds)
        results.append({"bench": "dsa_vs_mla", "seq": seq, "topk": TOPK,
                        "dsa_gflops": round(forward_flops(dsa, seq) / 1e9, 3),
                        "mla_gflops": round(forward_flops(mla, seq) / 1e9, 3),
                        "dsa_ms": round(seconds["dsa"] * 1e3, 1), "mla_ms": round(seconds["mla"] * 1e3, 1),
                        "dsa_over_mla": round(seconds["dsa"] / seconds["mla"], 3), "rounds": rounds,
                        "threads": torch.get_num_threads(), "load_1min": round(os.getloadavg()[0], 2)})
    return results


def table(results: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    columns = ["T", "keys kept per query", "GFLOPs DSA / MLA (declared)", "DSA ms", "MLA ms", "DSA / MLA",
               "load (1 min)"]
    rows = [[r["seq"], f"{min(r['topk'], r['seq'])} of up to {r['seq']}", f"{r['dsa_gflops']} / {r['mla_gflops']}",
             r["dsa_ms"], r["mla_ms"], f"{r['dsa_over_mla']:.2f}", r["load_1min"]] for r in results]
    return columns, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    add_table_arguments(parser)
    args = parser.parse_args()
    results = timing_rows(args.seq, args.rounds)
    for r in results:
        print(json.dumps(r), flush=True)
    if args.table:
        columns, rows = table(results)
        write_table(args.table, machine=args.machine, page="architectures",
                    title="DeepSeek Sparse Attention against dense MLA as T grows",
                    command=f"python bench/dsa_vs_mla.py --seq {' '.join(map(str, args.seq))} --rounds {args.rounds}",
                    setup=("One attention layer in training mode, forward + backward (the indexer's loss included), "
                           "batch 1, fp32, the default threads: DSA against the MLA it contains, the same weights, "
                           "at d_model 512 with DeepSeek-V3.2's proportions (8 heads; 64 + 32 query/key and 64 value "
                           "columns per head; latents 256 for keys and values, 192 for queries; an indexer of 8 "
                           f"heads of width 32 keeping {TOPK} keys per query); medians of alternating rounds."),
                    notes=("The selection is a mask over MLA's scores: attention still computes every key, so DSA "
                           "costs MLA's work plus the indexer's (its n_heads x head_dim products with every key, the "
                           "selection, and in training the main attention's probabilities for its loss), at every "
                           "T. It starts to pay only with a kernel that gathers each query's selected latent rows "
                           "(attention then reads topk keys, not T), which this implementation does not have. The "
                           "load column is the machine's 1-minute load average while the row ran: above the 2 "
                           "cores, other jobs shared them, which stretches both sides' times; the alternating rounds "
                           "keep the ratio."),
                    columns=columns, rows=rows, align=["r", "l", "l", "r", "r", "r", "r"])


if __name__ == "__main__":
    main()
