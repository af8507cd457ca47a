"""Load balance of `configs/tiny-moe.toml` (by default with tiny-gpt's blocks, as bench/moe_vs_dense.py runs it and the
README reports it) after N steps on the bundled corpus: the busiest expert's load over the mean
(1.0 = perfect), averaged over MoE layers and the last logged steps, for each way of balancing:
none, the auxiliary loss (Switch/GShard), and DeepSeek-V3's auxiliary-loss-free bias (sign rule after each step).
Same data, seed and steps for each; the final training loss shows what balancing costs or gains.

    python bench/moe_balance.py [--steps 200] [--out runs/bench-moe-balance]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_vs_dense import GPT2_BLOCKS  # noqa: E402  (this folder is on the path when run as a script)
from tables import add_table_arguments, write_table  # noqa: E402

from meshformer.config import load_config  # noqa: E402
from meshformer.train.trainer import Trainer  # noqa: E402

VARIANTS = {
    "none": ["model.moe.aux_loss=0", "model.moe.router_z_loss=0"],
    "aux_loss": ["model.moe.aux_loss=0.01", "model.moe.router_z_loss=0"],
    "bias": ["model.moe.aux_loss=0", "model.moe.router_z_loss=0", "model.moe.router_bias_update_rate=0.001"],
}


def run(name: str, steps: int, out: Path, extra: list[str]) -> dict[str, float]:
    overrides = [f"train.steps={steps}", "train.eval_interval=0", "train.sample_interval=0", "checkpoint.interval=0",
                 "logging.tensorboard=false", "logging.log_interval=10", "train.device=cpu",
                 f'logging.run_dir="{out / name}"', "checkpoint.resume=false", *VARIANTS[name], *extra]
    trainer = Trainer(load_config("tiny-moe", overrides))
    history = trainer.fit().history
    last = history[-max(1, len(history) // 4):]  # the last quarter of the logged steps
    loads = [v for h in last for k, v in h.items() if k.endswith("/load_max_over_mean")]
    return {"load_max_over_mean": round(statistics.mean(loads), 3), "worst_layer": round(max(loads), 3),
            "final_loss": round(history[-1]["train/loss"], 4)}


NAMES = {"none": "none", "aux_loss": "aux loss 0.01 (Switch/GShard)",
         "bias": "bias, rate 0.001 (DeepSeek-V3, no aux loss)"}


def table_rows(records: list[dict]) -> list[list[str]]:
    """One row per balancing method: mean load max/mean (worst layer), the most even in bold, and the final loss."""
    best = min(r["load_max_over_mean"] for r in records)
    rows = []
    for r in records:
        load = f"{r['load_max_over_mean']:.2f}"
        load = f"**{load}**" if r["load_max_over_mean"] == best else load
        rows.append([NAMES.get(r["balancing"], r["balancing"]), f"{load} ({r['worst_layer']:.2f})",
                     f"{r['final_loss']:.3f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-moe-balance"))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides (e.g. a smaller model)")
    parser.add_argument("--blocks", choices=["tiny-gpt", "config"], default="tiny-gpt",
                        help="tiny-gpt's blocks (moe_vs_dense.GPT2_BLOCKS, before --set) or tiny-moe's own")
    add_table_arguments(parser)
    args = parser.parse_args()
    records = []
    for name in args.variants:
        extra = [*(GPT2_BLOCKS if args.blocks == "tiny-gpt" else []), *args.set]
        records.append({"balancing": name, "steps": args.steps, **run(name, args.steps, args.out, extra)})
        print(json.dumps(records[-1]), flush=True)
    if args.table:
        write_table(args.table, machine=args.machine, page="moe", title="Balancing methods",
                    command="python bench/moe_balance.py",
                    setup=f"{args.steps} steps of the same MoE, same data and seed; the busiest expert over the mean, "
                          "averaged over layers and the last quarter of the run, worst layer in brackets.",
                    columns=["balancing", "load max/mean", f"train loss at step {args.steps}"],
                    rows=table_rows(records))


if __name__ == "__main__":
    main()
