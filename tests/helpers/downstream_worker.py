"""One rank of a downstream-scoring launch (`helpers.checkpoints.launch`): `downstream_worker.py KEY=VALUE ...`.

Builds the run's Trainer under its layout, restores the newest checkpoint of checkpoint.dir as a resumed run does,
scores downstream.tasks once without training, and prints rank 0's per-task metrics as one
`SCORES <json>` line. With `--texts`, the generation tasks again through the same in-loop `MeshformerLM` (the layout's
scorer and decoding step) with lm-eval's samples: each document's generated text in `TEXTS <json>`.
"""

from __future__ import annotations

import json
import os
import sys

from meshformer.config import load_config
from meshformer.runtime.distributed import init_distributed, shutdown_distributed
from meshformer.train.preflight import preflight
from meshformer.train.trainer import Trainer


def _texts(trainer: Trainer) -> dict[str, list[str]]:
    """Each generation task's texts, by document, as the in-loop evaluation (DownstreamEval.run) generates them."""
    from meshformer.eval.layout_forward import LayoutNextLogits, LayoutScorer
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate

    cfg, model, pad = trainer.cfg, trainer.parallel_model, trainer.tokenizer.pad_id
    batch = cfg.downstream.batch_size
    stepwise = LayoutNextLogits(model, cfg, batch, pad)
    lm = MeshformerLM(tokenizer=trainer.tokenizer, scorer=LayoutScorer(model, cfg, batch, pad, lambda: None),
                      batch_size=batch, max_length=cfg.data.seq_len, next_logits=stepwise)
    results = evaluate(lm, list(cfg.downstream.tasks), limit=int(cfg.downstream.limit), options=cfg.downstream,
                       log_samples=True)
    assert results is not None
    return {task: [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items() if isinstance(samples[0]["resps"][0][0], str)}


def main(overrides: list[str]) -> None:
    texts = "--texts" in overrides
    cfg = load_config(None, [o for o in overrides if o != "--texts"])
    rank = int(os.environ.get("RANK", 0))
    tokenizer = preflight(cfg)
    dims = init_distributed(cfg)
    try:
        trainer = Trainer(cfg, rank=rank, local_rank=rank, tokenizer=tokenizer, dims=dims)
        assert trainer.checkpoints.resume(trainer.checkpointable)
        assert trainer.downstream is not None
        trainer.downstream.run(trainer.parallel_model)
        scores = {name: {"metrics": metrics} for name, metrics in trainer.downstream.last.items()}
        generated = _texts(trainer) if texts else None
    finally:
        shutdown_distributed()
    if rank == 0:
        print("SCORES " + json.dumps(scores), flush=True)
        if generated is not None:
            print("TEXTS " + json.dumps(generated), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
