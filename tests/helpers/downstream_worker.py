"""One rank of a downstream-scoring launch (`helpers.checkpoints.launch`): `downstream_worker.py KEY=VALUE ...`.

Builds the run's Trainer under its layout, restores the newest checkpoint of checkpoint.dir as a resumed run does,
scores downstream.tasks once without training, and prints rank 0's per-task metrics as one
`SCORES <json>` line.
"""

from __future__ import annotations

import json
import os
import sys

from meshformer.config import load_config
from meshformer.runtime.distributed import init_distributed, shutdown_distributed
from meshformer.train.preflight import preflight
from meshformer.train.trainer import Trainer


def main(overrides: list[str]) -> None:
    cfg = load_config(None, overrides)
    rank = int(os.environ.get("RANK", 0))
    tokenizer = preflight(cfg)
    dims = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, rank=rank, local_rank=rank, tokenizer=tokenizer, dims=dims)
        assert trainer.checkpoints.resume(trainer.checkpointable)
        assert trainer.downstream is not None
        trainer.downstream.run(trainer.parallel_model)
        scores = {name: {"metrics": metrics} for name, metrics in trainer.downstream.last.items()}
    finally:
        shutdown_distributed()
    if rank == 0:
        print("SCORES " + json.dumps(scores), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
