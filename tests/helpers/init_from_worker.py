"""One rank of a training run launched by `helpers.checkpoints.launch`: `init_from_worker.py KEY=VALUE ...`.

Trains as `meshformer train` does (checkpoint.init_from resolved, preflight, process group, Trainer) and prints
rank 0's per-step history as one `HISTORY <json>` line, for tests that compare the losses.
"""

from __future__ import annotations

import json
import os
import sys

from meshformer.checkpointing.init_from import resolve_init_from
from meshformer.config import load_config
from meshformer.runtime.distributed import init_distributed, shutdown_distributed
from meshformer.train.preflight import preflight, run_folders_claimed
from meshformer.train.trainer import Trainer


def main(overrides: list[str]) -> None:
    cfg = resolve_init_from(load_config(None, overrides))
    rank = int(os.environ.get("RANK", 0))
    with run_folders_claimed(cfg):
        tokenizer = preflight(cfg)
        dims = init_distributed(cfg)
        try:
            result = Trainer(cfg, rank=rank, local_rank=rank, tokenizer=tokenizer, dims=dims).fit()
        finally:
            shutdown_distributed()
    if rank == 0:
        print("HISTORY " + json.dumps(result.history), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
