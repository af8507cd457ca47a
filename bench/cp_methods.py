"""The two context-parallel methods at equal world size and sequence length: parallel.cp_method="ulysses" against
"allgather" (the default), a forward and backward per step of the same model and batch on gloo processes, cp = the
world. Reported per model and T: Ulysses' step time and bytes sent per rank as ratios to the all-gather's, and the
planner's bytes ratio (meshformer/planner/context.py) beside the measured one.

Bytes are counted from the context-parallel collectives themselves (torch's functional all-gather, reduce-scatter
and all-to-all, forward and backward) under a dispatch mode: an all-gather sends its input to cp - 1 ranks, a
reduce-scatter and an all-to-all (cp - 1) / cp of theirs. FSDP's own collectives (parameters sharded over cp) are
the same for both methods and not counted.

CAVEAT: the processes share two CPU cores, so times show the exchange's overhead beside the compute, not GPU
scaling; the bytes are what a GPU run would move as well.

    python bench/cp_methods.py [--world 4] [--seq 256 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from parallel_common import batches, build_cpu_plan, spawn
from tables import add_table_arguments, write_table
from torch.utils._python_dispatch import TorchDispatchMode

from meshformer.config import Config, config_from_dict

D_MODEL, HEADS, LAYERS, BATCH = 256, 8, 4, 2
MODELS: dict[str, dict[str, Any]] = {
    # grouped-query attention, 8 query heads over 2 key/value heads
    "attention (GQA 8/2)": {"n_kv_heads": 2},
    # multi-head attention: Ulysses' q and output weigh as much as the keys and values
    "attention (MHA 8/8)": {},
    # Gated DeltaNet: the all-gather method passes the state piece by piece; Ulysses runs whole sequences per head
    "Gated DeltaNet": {"layer_types": ["linear_attention"],
                       "linear_attention": {"n_heads": HEADS, "key_head_dim": 32, "value_head_dim": 32,
                                            "chunk_size": 64}},
}
SENT_FRACTION = {"all_gather_into_tensor": lambda cp: cp - 1, "reduce_scatter_tensor": lambda cp: (cp - 1) / cp,
                 "all_to_all_single": lambda cp: (cp - 1) / cp}


def config(model: str, seq: int, cp: int, method: str) -> Config:
    extra = dict(MODELS[model])
    kv = extra.pop("n_kv_heads", None)
    return config_from_dict({
        "model": {"family": "decoder", "vocab_size": 4096, "d_model": D_MODEL, "n_layers": LAYERS,
                  "max_seq_len": seq, "position": "rope", "bias": False, "dropout": 0.0,
                  "attention": {"n_heads": HEADS, "n_kv_heads": kv}, "ffn": {"d_ff": 4 * D_MODEL},
                  "norm": {"kind": "rmsnorm"}, **extra},
        "data": {"seq_len": seq, "batch_size": BATCH},
        "train": {"device": "cpu", "seed": 0},
        "parallel": {"cp": cp, "cp_method": method},
    })


class CountSent(TorchDispatchMode):
    """Bytes this rank sends through the functional collectives (context parallel's), forward and backward."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        self.cp, self.sent = cp, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in SENT_FRACTION:
            t = args[0]
            self.sent += t.numel() * t.element_size() * SENT_FRACTION[name](self.cp)
        return func(*args, **(kwargs or {}))


def measure(model: str, seq: int, method: str, steps: int) -> dict[str, float]:
    import torch.distributed as dist

    cp = dist.get_world_size()
    cfg = config(model, seq, cp, method)
    plan = build_cpu_plan(cfg)
    data = batches(cfg, steps + 1)
    tokens = BATCH * seq
    times = []
    counter = CountSent(cp)
    for i, batch in enumerate(data):
        dist.barrier()
        start = time.perf_counter()
        if i == 0:  # the first step warms up; its collectives are counted (every step sends the same)
            with counter:
                plan.forward_backward(batch, tokens)
        else:
            plan.forward_backward(batch, tokens)
            times.append(time.perf_counter() - start)
        for part in plan.model_parts:
            part.zero_grad(set_to_none=True)
    return {"step_s": min(times), "sent": counter.sent}


def planned_ratio(model: str, seq: int, cp: int) -> float:
    from meshformer.planner.context import cp_costs

    gather, ulysses = cp_costs(config(model, seq, cp, "allgather"), cp)
    return ulysses.sent / gather.sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=4, help="processes = cp")
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add_table_arguments(parser)
    args = parser.parse_args()
    rows = []
    for model in args.models:
        for seq in args.seq:
            result = {}
            for method in ("allgather", "ulysses"):
                ranks = spawn(args.world, measure, model, seq, method, args.steps, threads=1)
                result[method] = {"step_s": max(r["step_s"] for r in ranks), "sent": max(r["sent"] for r in ranks)}
            record = {"model": model, "T": seq, "cp": args.world,
                      "time_ratio": round(result["ulysses"]["step_s"] / result["allgather"]["step_s"], 3),
                      "sent_ratio": round(result["ulysses"]["sent"] / result["allgather"]["sent"], 3),
                      "planned_sent_ratio": round(planned_ratio(model, seq, args.world), 3),
                      "allgather_sent_mib": round(result["allgather"]["sent"] / 2**20, 2)}
            print(json.dumps(record), flush=True)
            rows.append([model, seq, f"{record['time_ratio']:.2f}×", f"{record['sent_ratio']:.2f}×",
                         f"{record['planned_sent_ratio']:.2f}×", f"{record['allgather_sent_mib']:.2f}"])
    if args.table:
        write_table(args.table, machine=args.machine, page="parallel", title="Context parallel: Ulysses against all-gather",
                    command=f"python bench/cp_methods.py --world {args.world} --seq {' '.join(map(str, args.seq))}",
                    setup=f"A forward and backward of a {LAYERS}-layer decoder (d {D_MODEL}, {HEADS} heads, batch "
                          f"{BATCH}, fp32) on {args.world} gloo processes, cp = {args.world}, parallel.cp_method "
                          "ulysses against allgather in the same run; bytes: what one rank sends through the "
                          "context-parallel collectives per step, forward and backward.",
                    notes="Ratios are Ulysses over all-gather (below 1: Ulysses is faster or sends less). The "
                          "processes share two CPU cores: times show overhead, not GPU scaling.",
                    columns=["model", "T", "step time", "bytes sent", "planned bytes", "all-gather MiB sent"],
                    align=["l", "r", "r", "r", "r", "r"], rows=rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
