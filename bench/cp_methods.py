"""The two context-parallel methods at equal world size and sequence length: parallel.cp_method="ulysses" against
"allgather" (the default), a forward and backward per step of the same model and batch on gloo processes, cp = the
world. Reported per model and T: Ulysses' step time and bytes sent per rank as ratios to the all-gather's, and the
planner's bytes ratio (meshformer/planner/context_parallel_bytes.py) beside the measured one.

Bytes are counted at the context-parallel exchanges themselves (the model's `SequenceChunk.gather` and `exchange`,
wrapped): an all-gather sends its input to cp - 1 ranks and its backward reduce-scatter as much; an all-to-all
sends (cp - 1) / cp of its input, and its backward as much. FSDP's own collectives (parameters sharded over cp) are
the same for both methods and not counted. All cases run in one world of processes.

CAVEAT: the processes share two CPU cores, so times show the exchange's overhead beside the compute, not GPU
scaling; the bytes are what a GPU run would move as well.

    python bench/cp_methods.py [--world 4] [--seq 256 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from typing import Any

import torch
from parallel_common import batches, build_cpu_plan, spawn
from tables import add_table_arguments, write_table

from meshformer.config import Config, config_from_dict
from meshformer.model.attention import SequenceChunk

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


def measure(cases: list[tuple[str, int]], steps: int) -> list[dict[str, float]]:
    """Every (model, T) under both methods in this one world: the fastest of `steps` steps after a warm-up, and
    the bytes this rank sent in the warm-up step (every step sends the same)."""
    import torch.distributed as dist

    cp = dist.get_world_size()
    out = []
    for model, seq in cases:
        for method in ("allgather", "ulysses"):
            cfg = config(model, seq, cp, method)
            plan = build_cpu_plan(cfg)
            sent = [0.0]
            part = plan.model_parts[0]
            chunk = part.parallel_context.chunk
            assert chunk is not None and chunk.ulysses == (method == "ulysses")

            # forward sends; each backward (reduce-scatter of a gather, the reverse all-to-all) sends as much again
            def gather(t: torch.Tensor, chunk: SequenceChunk = chunk, sent: list[float] = sent) -> torch.Tensor:
                sent[0] += 2 * t.numel() * t.element_size() * (cp - 1)
                return chunk.gather(t)

            def exchange(t: torch.Tensor, chunk: SequenceChunk = chunk, sent: list[float] = sent) -> torch.Tensor:
                assert chunk.exchange is not None
                sent[0] += 2 * t.numel() * t.element_size() * (cp - 1) / cp
                return chunk.exchange(t)

            counted = replace(chunk, gather=gather, exchange=exchange if chunk.ulysses else None)
            part.parallel_context = replace(part.parallel_context, chunk=counted)
            data = batches(cfg, steps + 1)  # a warm-up, then `steps` timed
            times = []
            for i, batch in enumerate(data):
                dist.barrier()
                start = time.perf_counter()
                plan.forward_backward(batch, BATCH * seq)
                if i == 0:
                    first = sent[0]
                else:
                    times.append(time.perf_counter() - start)
                for p in part.parameters():
                    p.grad = None
            out.append({"model": model, "T": seq, "method": method, "step_s": min(times), "sent": first})
    return out


def planned_ratio(model: str, seq: int, cp: int) -> float:
    from meshformer.planner.context_parallel_bytes import cp_costs

    gather, ulysses = cp_costs(config(model, seq, cp, "allgather"), cp)
    return ulysses.sent / gather.sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=int, default=4, help="processes = cp")
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    add_table_arguments(parser)
    args = parser.parse_args()
    cases = [(model, seq) for model in args.models for seq in args.seq]
    ranks = spawn(args.world, measure, cases, args.steps, threads=1)
    rows = []
    for model, seq in cases:
        result = {}
        for method in ("allgather", "ulysses"):
            mine = [r for rank in ranks for r in rank if (r["model"], r["T"], r["method"]) == (model, seq, method)]
            result[method] = {"step_s": max(r["step_s"] for r in mine), "sent": max(r["sent"] for r in mine)}
        record = {"model": model, "T": seq, "cp": args.world,
                  "time_ratio": round(result["ulysses"]["step_s"] / result["allgather"]["step_s"], 3),
                  "sent_ratio": round(result["ulysses"]["sent"] / result["allgather"]["sent"], 3),
                  "planned_sent_ratio": round(planned_ratio(model, seq, args.world), 3),
                  "allgather_sent_mib": round(result["allgather"]["sent"] / 2**20, 2)}
        print(json.dumps(record), flush=True)
        rows.append([model, seq, f"{record['time_ratio']:.2f}×", f"{record['sent_ratio']:.2f}×",
                     f"{record['planned_sent_ratio']:.2f}×", f"{record['allgather_sent_mib']:.2f}"])
    if args.table:
        write_table(args.table, machine=args.machine, page="parallel",
                    title="Context parallel: Ulysses against all-gather",
                    command=f"python bench/cp_methods.py --world {args.world} --seq {' '.join(map(str, args.seq))} "
                            f"--steps {args.steps}",
                    setup=f"A forward and backward of a {LAYERS}-layer decoder (d {D_MODEL}, {HEADS} heads, batch "
                          f"{BATCH}, fp32) on {args.world} gloo processes, cp = {args.world}, parallel.cp_method "
                          "ulysses against allgather in the same run; bytes: what one rank sends through the "
                          "context-parallel collectives per step, forward and backward.",
                    notes="Ratios are Ulysses over all-gather (below 1: Ulysses is faster or sends less); time: "
                          f"the fastest of {args.steps} steps after a warm-up. The processes share two CPU cores "
                          "with other work, so times are noisy and show overhead, not GPU scaling; the bytes are "
                          "exact and what a GPU run moves too.",
                    columns=["model", "T", "step time", "bytes sent", "planned bytes", "all-gather MiB sent"],
                    align=["l", "r", "r", "r", "r", "r"], rows=rows)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
