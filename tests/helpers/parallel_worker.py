"""A tiny torchrun entry point for launch tests: `torchrun ... tests/helpers/parallel_worker.py MODE`.

MODE: ok (an FSDP step, prints the world), fail (rank 1 raises), hang (rank 1 skips a collective).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers importable

import torch
import torch.distributed as dist

from helpers.parallel import build_cpu_plan, make_batches, make_config
from meshformer.runtime.distributed import init_distributed, shutdown_distributed


def main(mode: str) -> None:
    cfg = make_config("decoder", {"timeout_s": 4.0})
    init_distributed(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if mode == "ok":
            plan = build_cpu_plan(cfg)
            batch = {k: v.chunk(plan.dp_size)[plan.dp_rank] for k, v in make_batches(cfg, 1)[0].items()}
            tokens = plan.global_token_count([batch])
            loss = plan.reduce_for_logging(plan.forward_backward(batch, tokens)) / float(tokens)
            print(f"worker rank {rank} of {world}: loss {loss:.6f} layout {plan.report['layout']}", flush=True)
        elif mode == "fail":
            if rank == 1:
                raise ValueError("injected failure on rank 1")
            dist.barrier()
        elif mode == "hang":
            if rank == 1:
                time.sleep(8)  # never joins the all-reduce below
                return
            dist.all_reduce(torch.ones(3))
    finally:
        if mode == "ok":
            shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
