"""Random model configs and what the accounting says of them: parameter counts, training FLOPs and the planner's
per-rank bytes. tests/fixtures/component_reference.json holds these values as an earlier tree computed them
(`python tests/helpers/component_reference.py OUT.json`), so a test can hold the block-component registry to them.

Only public entry points are called (count_params, training_flops, planner.memory.rank_memory with a hand-made
RankShare), so the same script runs on any tree that has them.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

import meshformer
from meshformer.config import Config
from meshformer.config.sections import DataConfig, ParallelConfig, TrainConfig
from meshformer.model.config import (
    AttentionConfig,
    FfnConfig,
    InitConfig,
    ModelConfig,
    MoeConfig,
    NormConfig,
    RopeConfig,
)

SEED, COUNT = 20261129, 300


def random_case(rng: random.Random) -> dict[str, Any]:
    """One case: a [model] table (nested dicts) and the layout and data sizes the planner is asked about."""
    family = rng.choice(["decoder", "decoder", "encoder", "encoder_decoder"])
    heads = rng.choice([2, 4, 8])
    d_model = heads * rng.choice([8, 16])
    n_layers = rng.randint(1, 6)
    experts = rng.choice([0, 0, 4, 8])
    window = rng.choice([None, None, 8, 24])
    layer_types: list[str] = []
    if window is not None:
        layer_types = rng.choice([["sliding_attention"], ["sliding_attention", "full_attention"],
                                  ["full_attention", "sliding_attention", "sliding_attention"][:n_layers]])
        if "sliding_attention" not in layer_types:
            layer_types = ["sliding_attention"]
    mlp_types: list[str] = []
    if experts:
        mlp_types = rng.choice([[], ["dense", "moe"][:max(1, n_layers)], ["moe", "dense", "moe"][:n_layers]])
    attention = dict(n_heads=heads, n_kv_heads=rng.choice([None, heads, heads // 2, 1]),
                     head_dim=rng.choice([None, 8, 16]), qk_norm=rng.random() < 0.3,
                     qkv_bias=rng.choice([None, True, False]), window=window, sinks=rng.random() < 0.2,
                     dropout=rng.choice([0.0, 0.0, 0.1]), softcap=rng.choice([None, None, 30.0]),
                     backend=rng.choice(["auto", "auto", "math", "sdpa"]), document_mask=rng.random() < 0.2)
    if attention["qk_norm"]:
        attention["qk_norm_scope"] = rng.choice(["head", "projection"])
    activation = rng.choice(["relu", "gelu", "gelu_tanh", "swiglu", "geglu", "swiglu_clamped"])
    model = dict(
        family=family, vocab_size=rng.choice([256, 512, 1000]), d_model=d_model, n_layers=n_layers,
        n_encoder_layers=rng.choice([None, rng.randint(1, 4)]), n_decoder_layers=rng.choice([None, rng.randint(1, 4)]),
        position=rng.choice(["learned", "rope", "sinusoidal", "alibi", "t5_relative", "none"]), max_seq_len=256,
        tie_embeddings=rng.random() < 0.6, share_embeddings=rng.random() < 0.7, bias=rng.random() < 0.5,
        head_transform=rng.random() < 0.3, output_bias=rng.random() < 0.3, dropout=rng.choice([0.0, 0.1]),
        cross_downsample=rng.choice([1, 1, 2]), layer_types=layer_types, mlp_types=mlp_types,
        attention=attention, ffn=dict(d_ff=rng.choice([32, 64, 96, 128]), activation=activation),
        rope=dict(theta=10000.0), init=dict(std=0.02),
        norm=dict(kind=rng.choice(["layernorm", "rmsnorm"]), position=rng.choice(["pre", "post", "post_sublayer",
                                                                                  "sandwich"]),
                  final=rng.choice([None, True, False]), embedding=rng.random() < 0.2),
        moe=dict(n_experts=experts, experts_per_token=rng.choice([1, 2]), d_ff=rng.choice([0, 16, 48]),
                 n_shared_experts=rng.choice([0, 0, 1, 2]), router_bias=rng.random() < 0.3,
                 expert_linear_bias=rng.random() < 0.3, capacity_factor=rng.choice([0.0, 0.0, 1.25]),
                 aux_loss=rng.choice([0.0, 0.01]), router_z_loss=rng.choice([0.0, 0.001])),
    )
    tp = rng.choice([1, 1, 2])
    cp = 1 if family == "encoder_decoder" else rng.choice([1, 1, 2])
    ep = 1 if not experts else rng.choice([e for e in (1, 2, 4) if experts % e == 0 and e % (tp * cp) == 0] or [1])
    layout = dict(tp=tp, cp=cp, ep=ep, pp=rng.choice([1, 1, 2]), recompute=rng.choice(["none", "selective", "full"]),
                  dp_shard=rng.choice([1, 2]), dtype=rng.choice(["fp32", "bf16"]), seq_len=rng.choice([32, 64, 128]),
                  target_len=rng.choice([16, 32]), batch_size=rng.choice([2, 4]))
    return {"model": model, "layout": layout}


def model_config(table: dict[str, Any]) -> ModelConfig:
    sub = {"attention": AttentionConfig, "ffn": FfnConfig, "rope": RopeConfig, "norm": NormConfig, "moe": MoeConfig,
           "init": InitConfig}
    return ModelConfig(**{k: sub[k](**v) if k in sub else v for k, v in table.items()})


def planner_config(case: dict[str, Any]) -> Config:
    layout = case["layout"]
    parallel = ParallelConfig(tp=layout["tp"], cp=layout["cp"], ep=layout["ep"], pp=layout["pp"],
                              dp_shard=layout["dp_shard"], recompute=layout["recompute"])
    data = DataConfig(seq_len=layout["seq_len"], target_len=layout["target_len"], batch_size=layout["batch_size"])
    return Config(model=model_config(case["model"]), data=data, parallel=parallel,
                  train=TrainConfig(dtype=layout["dtype"], device="cuda"))


def per_rank_bytes(cfg: Config) -> list[dict[str, Any]]:
    """rank_memory of every pipeline rank for a share holding its half (pp 2) or all of the blocks."""
    from meshformer.model.families import get_family_spec
    from meshformer.parallel_dims import ParallelDims
    from meshformer.planner.memory import rank_memory
    from meshformer.planner.shard import RankShare

    p = cfg.parallel
    world = p.pp * p.tp * p.cp * p.dp_shard
    dims = ParallelDims.from_config(p, world)
    total = get_family_spec(cfg.model.family).total_layers(cfg.model)
    cut = total // 2 if p.pp > 1 else total
    spans = [tuple(range(cut)), tuple(range(cut, total))] if p.pp > 1 else [tuple(range(total))]
    out = []
    for rank, layers in enumerate(spans):
        share = RankShare(rank, layers, 1, 1000, 500, 200, rank == 0, rank == len(spans) - 1)
        memory = dataclasses.asdict(rank_memory(cfg, dims, share))
        out.append({k: memory[k] for k in ("activations", "activations_per_microbatch", "peak", "peak_at")})
    return out


def reference(case: dict[str, Any]) -> dict[str, Any]:
    from meshformer.model.flops import count_params, flops_per_token, training_flops

    m = model_config(case["model"])
    layout = case["layout"]
    counts = count_params(m)
    assert counts.pop("mtp") == 0  # the recorded configs have no multi-token prediction (nor its breakdown entry)
    return {
        "params": counts,
        "training_flops": [training_flops(m, s, t) for s, t in ((layout["seq_len"], None),
                                                                 (layout["seq_len"], layout["target_len"]),
                                                                 (7, 5))],
        "flops_per_token": flops_per_token(m, layout["seq_len"], layout["target_len"]),
        "ranks": per_rank_bytes(planner_config(case)),
    }


def cases() -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    return [random_case(rng) for _ in range(COUNT)]


# Whole searches (tp_template, template_shares, rank_memory) of a few configs: (config file, overrides, world size)
SEARCHES = [
    ("tiny-gpt.toml", ["model.moe.n_experts=4", 'model.mlp_types=["dense", "moe"]'], 4),
    ("tiny-gpt.toml", ["model.attention.window=16", 'model.layer_types=["sliding_attention", "full_attention"]'], 4),
    ("tiny-t5.toml", [], 2),
]


def searched(name: str, overrides: list[str], world: int) -> list[list]:
    from meshformer.config import load_config
    from meshformer.planner.search import search_layouts

    cfg = load_config(Path(meshformer.__file__).parent / "configs" / name, overrides)
    return [[r.pp, r.tp, r.cp, r.ep, r.recompute, r.peak] for r in search_layouts(cfg, world, "h100-80gb")]


if __name__ == "__main__":
    rows = [{**case, "expected": reference(case)} for case in cases()]
    searches = [[name, overrides, world, searched(name, overrides, world)] for name, overrides, world in SEARCHES]
    with open(sys.argv[1], "w") as f:
        json.dump({"cases": rows, "searches": searches}, f, indent=None, separators=(",", ":"))
        f.write("\n")
