"""Expert-parallel dispatch overhead on gloo: a training step of an MoE decoder at ep = 1, 2, 4 on the same world
and global batch, as a ratio to ep = 1 (every expert on every rank, FSDP-sharded like the other weights).

CAVEAT: this machine has 2 CPU cores shared by every process, so the figures are the *overhead* of the exchange
(counts and rows all-to-all, regrouping by expert, a host sync per layer), not the memory and compute that EP saves
on GPUs. `exchange_share` is the fraction of a (profiled) step spent inside the exchange's all-to-alls, launched and
waited for (forward and backward).

    python bench/moe_expert_parallel.py [--world 4] [--steps 4] [--ep 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from parallel_common import batches, spawn
from tables import add_table_arguments, write_table

from meshformer.config import Config, OptimConfig, ScheduleConfig, config_from_dict
from meshformer.optim import AdamWConfig

GLOBAL_BATCH, SEQ, D_MODEL = 16, 128, 256
# The expert exchange's collectives (meshformer/parallel/expert_parallel.py): torch's functional all-to-alls
EXCHANGE_OPS = {"_c10d_functional::all_to_all_single", "_c10d_functional::wait_tensor"}


def moe_config(parallel: dict, batch: int) -> Config:
    return config_from_dict({
        "model": {"family": "decoder", "vocab_size": 4096, "d_model": D_MODEL, "n_heads": 8, "d_ff": 4 * D_MODEL,
                  "n_layers": 4, "max_seq_len": SEQ, "position": "rope", "norm": "rmsnorm", "activation": "swiglu",
                  "bias": False, "dropout": 0.0, "n_experts": 8, "experts_per_token": 2, "moe_d_ff": 2 * D_MODEL,
                  "moe_aux_loss": 0.01},
        "data": {"seq_len": SEQ, "batch_size": batch},
        "train": {"device": "cpu", "seed": 0},
        "parallel": parallel,
    })


def measure(ep: int, steps: int) -> dict[str, float]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from meshformer.train.step import TrainStep
    from tests.helpers.parallel import build_cpu_plan

    world = dist.get_world_size()
    cfg = moe_config({"dp_shard": world, "ep": ep}, GLOBAL_BATCH // world)
    plan = build_cpu_plan(cfg)
    training = TrainStep(plan, OptimConfig(lr=1e-4, weight_decay=0.0, grad_clip=1.0,
                                           adamw=AdamWConfig(implementation="fused")),
                         ScheduleConfig(name="constant", warmup_steps=0), steps + 1, D_MODEL)
    data = [{k: v.chunk(world)[plan.dp_rank] for k, v in b.items()}
            for b in batches(moe_config({}, GLOBAL_BATCH), steps + 2)]
    times = []
    for batch in data[:-1]:
        dist.barrier()
        start = time.perf_counter()
        training.step([batch])
        times.append(time.perf_counter() - start)
    # The exchange's share from one more step under the profiler (it slows every op a little, so the share is taken
    # within that step): its functional all-to-alls, launched and waited for, forward and backward
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        training.step([data[-1]])
        profiled = time.perf_counter() - start
    spent = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in EXCHANGE_OPS) / 1e6
    return {"step_s": min(times[1:]), "exchange_share": spent / profiled}  # the first step warms up


def table_rows(runs: list[list[dict]]) -> list[list[str]]:
    """Two rows, a column per ep: tokens/s against ep 1 and the all-to-alls' share of the step, each run's value
    separated by /."""
    def cells(key: str, fmt: str) -> list[str]:
        per_ep = zip(*([fmt.format(r[key]) for r in run] for run in runs), strict=True)
        return [" / ".join(values) for values in per_ep]
    return [["tokens/s against ep 1", *cells("ratio_to_ep1", "{:.2f}×")],
            ["all-to-alls' share of the step", *cells("exchange_share", "{:.1%}")]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole measurement (the table shows each)")
    add_table_arguments(parser)
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        base, records = None, []
        for ep in args.ep:
            ranks = spawn(args.world, measure, ep, args.steps, threads=1)
            step = max(r["step_s"] for r in ranks)
            base = base or step
            records.append({"ep": ep, "processes": args.world, "tokens_per_s": round(GLOBAL_BATCH * SEQ / step),
                            "ratio_to_ep1": round(base / step, 3),
                            "exchange_share": round(max(r["exchange_share"] for r in ranks), 3),
                            "note": "shared CPU cores: overhead, not scaling"})
            print(json.dumps(records[-1]), flush=True)
        runs.append(records)
    if args.table:
        write_table(args.table, machine=args.machine, page="moe", title="Expert-parallel dispatch",
                    command=f"python bench/moe_expert_parallel.py --runs {args.runs}",
                    setup=f"Training steps of a 4-layer MoE decoder (d {D_MODEL}, 8 experts top-2) on "
                          f"{args.world} gloo processes, FSDP over all {args.world}, the same global batch of "
                          f"{GLOBAL_BATCH} × {SEQ} tokens at ep {', '.join(map(str, args.ep))}; the share is the "
                          "all-to-alls' time, launched and waited for, in a profiled step. "
                          f"{len(runs)} run{'s' * (len(runs) != 1)}, separated by /.",
                    notes="Several processes on two cores measure overhead, not scaling; ep > 1 is no slower here "
                          "because each rank gathers and runs fewer, larger experts.",
                    columns=["", *(f"ep {ep}" for ep in args.ep)], align=["l", *("r" * len(args.ep))],
                    rows=table_rows(runs))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
