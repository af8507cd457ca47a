"""Predicted vs measured peak memory on small CPU/gloo layouts (`bench/plan_vs_measured.py`,
tests/unit/planner/test_plan.py).

A small Llama-style decoder (RMSNorm, SwiGLU, RoPE, untied here so both ends of a pipeline hold a table) whose
activations outweigh its weights, as in real training. Each rank measures its own peak of live tensor bytes
over one training step (`measure.measure_step_peak`); the prediction is the planner's worst rank, computed in
the parent process under a fake process group of the same size.
"""

from __future__ import annotations

from typing import Any

from meshformer.config import Config, config_from_dict

# The mixture-of-experts variant: every feed-forward 4 experts of width 256, 2 per token (the dense model's active
# width), with both balance losses (the router keeps its logits).
MOE: dict[str, Any] = {"moe": {"n_experts": 4, "experts_per_token": 2, "d_ff": 256, "aux_loss": 0.01,
                               "router_z_loss": 0.001}}
# world size -> layouts (parallel-section overrides; under "model", model overrides); one process launch per world.
LAYOUTS: dict[int, list[dict[str, Any]]] = {
    1: [{}, {"recompute": "selective"}, {"recompute": "full"}, {"model": MOE},
        {"recompute": "selective", "model": MOE}, {"recompute": "full", "model": MOE}],
    2: [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}, {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4},
        {"dp_shard": 2, "recompute": "full", "mixed_precision_param": "bf16"}, {"cp": 2},
        {"ep": 2, "model": MOE}, {"ep": 2, "recompute": "full", "model": MOE}],
    4: [{"tp": 2, "recompute": "selective"}, {"pp": 2, "tp": 2},
        {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_stages_per_rank": 2},
        {"dp_replicate": 2, "recompute": "every_k"}, {"cp": 2, "recompute": "selective"}, {"cp": 4},
        {"ep": 2, "model": MOE}],
}
TOLERANCE = 0.10


def validation_config(parallel: dict[str, Any], *, d_model: int = 128, n_layers: int = 4, seq: int = 128,
                      batch: int = 4, vocab: int = 512, tie_embeddings: bool = False) -> Config:
    parallel = dict(parallel)
    model = parallel.pop("model", {})
    raw = {
        "model": {"family": "decoder", "vocab_size": vocab, "d_model": d_model, "n_layers": n_layers,
                  "max_seq_len": seq, "position": "rope", "bias": False, "tie_embeddings": tie_embeddings,
                  "attention": {"n_heads": 8, "n_kv_heads": 4}, "ffn": {"d_ff": 4 * d_model, "activation": "swiglu"},
                  "norm": {"kind": "rmsnorm"}, **model},
        "data": {"seq_len": seq, "batch_size": batch},
        "train": {"device": "cpu", "seed": 0},
        "parallel": parallel,
    }
    return config_from_dict(raw)  # validated


def measure_layouts(layouts: list[dict[str, Any]]) -> list[dict[str, float]]:
    """This rank's measured peak (bytes) and routing imbalance for each layout, one after another in this process
    group (`measure.measure_step_peak`)."""
    from meshformer.planner.measure import measure_step_peak

    return [measure_step_peak(validation_config(layout)) for layout in layouts]


def predicted_peak(layout: dict[str, Any], world: int, moe_imbalance: float | None = None) -> float:
    """The planner's worst rank; `moe_imbalance` None: the planner's default."""
    from meshformer.planner.search import plan_layout

    cfg = validation_config(layout)
    return (plan_layout(cfg, world) if moe_imbalance is None else plan_layout(cfg, world, moe_imbalance)).peak


def compare(world: int, layouts: list[dict[str, Any]], per_rank: list[list[dict[str, float]]]
            ) -> list[dict[str, Any]]:
    """Rows of (layout, predicted, measured worst rank, relative error) from every rank's measurements. An
    expert-parallel layout is predicted at the routing imbalance the step measured (the worst rank's), so the
    accounting is tested, not the router; `predicted_default` is the planner's default-imbalance answer."""
    rows = []
    for i, layout in enumerate(layouts):
        measured = max(rank[i]["peak"] for rank in per_rank)
        imbalance = max(rank[i]["moe_imbalance"] for rank in per_rank)
        predicted = predicted_peak(layout, world, imbalance)
        rows.append({"world": world, "layout": layout or {"single": "process"}, "predicted": predicted,
                     "measured": measured, "error": predicted / measured - 1, "moe_imbalance": imbalance,
                     "predicted_default": predicted_peak(layout, world)})
    return rows
