"""Peak memory of the final weights save (`save_weights`) per rank under FSDP over gloo CPU processes.

Each rank resets its peak RSS (Linux: /proc/self/clear_refs) just before the save and reads it after: the
growth is what the save itself holds (gathered tensors, received tensors, buffers of the file being written).
Reported against the fp32 model and its largest tensor; goal: about one tensor beyond the rank's own shards,
whatever --max-shard-size (the default 5GB puts any model below 5 GB in one file).

    python bench/final_save_memory.py [--ranks 8] [--d-model 384] [--layers 8] [--vocab 8192]
                                      [--max-shard-size 5GB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from parallel_common import bench_config, build_cpu_plan, spawn


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def measure(d_model: int, layers: int, vocab: int, max_shard_size: str, out: str) -> dict[str, int]:
    import gc

    import torch.distributed as dist

    import meshformer.checkpointing.manager  # noqa: F401  (a trainer has it loaded: its code is not the save's memory)
    from meshformer.checkpointing.weights import save_weights

    cfg = bench_config({"dp_shard": -1}, d_model=d_model, n_layers=layers, vocab=vocab, batch=8, seq=64)
    plan = build_cpu_plan(cfg)
    gc.collect()
    dist.barrier()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS from here on
    save_weights(plan, Path(out) / "final", max_shard_size)
    peak = _status_kib("VmHWM")
    full = {name: p.numel() * 4 for name, p in plan.model_parts[0].state_dict().items()}
    return {"growth": (peak - before) * 1024, "model": sum(full.values()), "largest": max(full.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--max-shard-size", default="5GB")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = spawn(args.ranks, measure, args.d_model, args.layers, args.vocab, args.max_shard_size, tmp,
                         threads=1)
    model, largest = per_rank[0]["model"], per_rank[0]["largest"]
    worst = max(r["growth"] for r in per_rank)
    result = {"fsdp_ranks": args.ranks, "max_shard_size": args.max_shard_size,
              "model_fp32_MiB": round(model / 2**20, 1), "largest_tensor_MiB": round(largest / 2**20, 1),
              "rank0_growth_MiB": round(per_rank[0]["growth"] / 2**20, 1),
              "max_rank_growth_MiB": round(worst / 2**20, 1),
              "max_rank_growth_over_model": round(worst / model, 3),
              "max_rank_growth_over_largest_tensor": round(worst / largest, 2)}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
