"""Predicted vs measured peak memory on small CPU/gloo layouts (`bench/plan_vs_measured.py`, tests/unit/test_plan.py).

A small Llama-style decoder (RMSNorm, SwiGLU, RoPE, untied here so both ends of a pipeline hold a table) whose
activations outweigh its weights, as in real training. Each rank measures its own peak of live tensor bytes
over one training step (`measure.measure_step_peak`); the prediction is the planner's worst rank, computed in
the parent process under a fake process group of the same size.
"""

from __future__ import annotations

from typing import Any

from meshformer.config import Config, config_from_dict

# world size -> layouts (parallel-section overrides); one process launch per world size.
LAYOUTS: dict[int, list[dict[str, Any]]] = {
    1: [{}, {"recompute": "selective"}, {"recompute": "full"}],
    2: [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}, {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4},
        {"dp_shard": 2, "recompute": "full", "mixed_precision_param": "bf16"}, {"cp": 2}],
    4: [{"tp": 2, "recompute": "selective"}, {"pp": 2, "tp": 2},
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2},
        {"dp_replicate": 2, "recompute": "every_k"}, {"cp": 2, "recompute": "selective"}, {"cp": 4}],
}
TOLERANCE = 0.10


def validation_config(parallel: dict[str, Any], *, d_model: int = 128, n_layers: int = 4, seq: int = 128,
                      batch: int = 4, vocab: int = 512, tie_embeddings: bool = False) -> Config:
    raw = {
        "model": {"family": "decoder", "vocab_size": vocab, "d_model": d_model, "n_heads": 8, "n_kv_heads": 4,
                  "d_ff": 4 * d_model, "n_layers": n_layers, "max_seq_len": seq, "position": "rope",
                  "norm": "rmsnorm", "activation": "swiglu", "bias": False, "tie_embeddings": tie_embeddings},
        "data": {"seq_len": seq, "batch_size": batch},
        "train": {"device": "cpu", "seed": 0},
        "parallel": parallel,
    }
    return config_from_dict(raw)  # validated


def measure_layouts(layouts: list[dict[str, Any]]) -> list[int]:
    """This rank's measured peak (bytes) for each layout, one after another in this process group."""
    from meshformer.planner.measure import measure_step_peak

    return [measure_step_peak(validation_config(layout))["peak"] for layout in layouts]


def predicted_peak(layout: dict[str, Any], world: int) -> float:
    from meshformer.planner.search import plan_layout

    return plan_layout(validation_config(layout), world).peak


def compare(world: int, layouts: list[dict[str, Any]], per_rank: list[list[int]]) -> list[dict[str, Any]]:
    """Rows of (layout, predicted, measured worst rank, relative error) from every rank's measurements."""
    rows = []
    for i, layout in enumerate(layouts):
        measured = max(rank[i] for rank in per_rank)
        predicted = predicted_peak(layout, world)
        rows.append({"world": world, "layout": layout or {"single": "process"}, "predicted": predicted,
                     "measured": measured, "error": predicted / measured - 1})
    return rows
