"""Memory per rank of parameters + gradients + optimizer state under FSDP over 1, 2 and 4 ranks.

Counts the bytes of each rank's local shards after one AdamW step (exact, unlike RSS, which also holds
the allocator's caches and the Python runtime). Goal: 4 ranks <= 0.27x of 1 rank.

    python bench/parallel_memory.py [--d-model 256] [--layers 8]
"""

from __future__ import annotations

import argparse
import json

import torch
from parallel_common import batches, bench_config, build_cpu_plan, spawn
from tables import add_table_arguments, write_row


def local_bytes(t: torch.Tensor) -> int:
    from meshformer.parallel.grad_norm import local_tensor

    local = local_tensor(t)
    return local.numel() * local.element_size()


def measure(d_model: int, layers: int) -> dict[str, int]:

    cfg = bench_config({"dp_shard": -1}, d_model=d_model, n_layers=layers, batch=4, seq=64)
    plan = build_cpu_plan(cfg)
    params = {id(p): p for part in plan.model_parts for p in part.parameters()}.values()
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    batch = {k: v.chunk(plan.dp_size)[plan.dp_rank] for k, v in batches(cfg, 1)[0].items()}
    plan.forward_backward(batch, plan.global_token_count([batch]))
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local_bytes(t) for t in state),
    }


SUMMARY = ["`bench/parallel_memory.py`", "parameter + gradient + optimizer memory per rank, FSDP 1/2/4"]


def table_row(records: list[dict]) -> list[str]:
    """parallel-01-cpu.json's row: each FSDP size's largest rank over one rank's."""
    return [*SUMMARY, " / ".join(f"{r['ratio_to_1_rank']:.2f}" for r in records)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    add_table_arguments(parser)
    args = parser.parse_args()
    base = None
    records = []
    for world in (1, 2, 4):
        per_rank = spawn(world, measure, args.d_model, args.layers)
        worst = max(sum(r.values()) for r in per_rank)
        base = base or worst
        parts = {k: max(r[k] for r in per_rank) / 2**20 for k in per_rank[0]}
        record = {"fsdp_ranks": world, "max_rank_MiB": round(worst / 2**20, 2),
                          "ratio_to_1_rank": round(worst / base, 4), "goal": "<= 0.27 at 4 ranks" if world == 4 else "",
                          **{f"{k}_MiB": round(v, 2) for k, v in parts.items()}}
        records.append(record)
        print(json.dumps(record))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
