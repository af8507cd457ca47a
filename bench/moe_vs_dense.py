"""tiny-moe against the dense model with the same active parameters (tiny-gpt): loss vs tokens, same data, same
steps, same seed, fp32 on CPU, each trained through the real `meshformer train` command (issue 21, item 6).

Writes a PNG of train and eval loss against tokens seen, and prints one JSON line per run plus a Markdown table.

    PYTHONPATH=$PWD python bench/moe_vs_dense.py --steps 300 --png docs/moe_vs_dense.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402  (bench/ is on the path when run as a script)

# The MoE run's default overrides: tiny-gpt's blocks (LayerNorm, learned positions, biases) and GELU experts of width
# 256, so that only the feed-forward differs from the dense model, at its active parameter count (tiny-moe itself
# has Mixtral's blocks, to export as MixtralForCausalLM). The README's figures are of this model.
GPT2_BLOCKS = ["model.norm.kind=layernorm", "model.position=learned", "model.ffn.activation=gelu", "model.bias=true",
               "model.moe.d_ff=256"]
STEP_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+)")
EVAL_LINE = re.compile(r"eval\s+(\d+) \| loss ([0-9.]+)")


def train(config: str, steps: int, eval_interval: int, run_dir: Path, overrides: list[str], threads: int) -> dict:
    """One run through the CLI; the curves are read back from its console log (what a user sees)."""
    cmd = [sys.executable, "-m", "meshformer", "train", str(ROOT / "configs" / f"{config}.toml"), "--set",
           f"train.steps={steps}", f"train.eval_interval={eval_interval}", "train.sample_interval=0",
           "train.dtype=fp32", "train.device=cpu", f"logging.run_dir={run_dir}", "checkpoint.interval=0",
           "checkpoint.resume=false", "logging.tensorboard=false", f"logging.log_interval={max(1, eval_interval // 4)}",
           *overrides]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep extra site folders
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "console.log"  # streamed, so a long run can be watched with tail -f
    with log_path.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return {"config": config, "proc": proc, "log": log_path, "t0": t0}


def finish(run: dict) -> dict:
    returncode = run.pop("proc").wait()
    log = run["log"].read_text()
    if returncode != 0:
        raise SystemExit(f"{run['config']} failed ({returncode}):\n{log[-3000:]}")
    train_curve = [(int(s), float(v)) for s, v in STEP_LINE.findall(log)]
    eval_curve = [(int(s), float(v)) for s, v in EVAL_LINE.findall(log)]
    return run | {"train": train_curve, "eval": eval_curve, "seconds": time.perf_counter() - run["t0"]}


def active_params(config: str, overrides: list[str]) -> tuple[int, int]:
    from meshformer.config.load import load_config
    from meshformer.model.flops import count_params

    cfg = load_config(ROOT / "configs" / f"{config}.toml", overrides)
    counts = count_params(cfg.model)
    return counts["total"], counts["active"]


def plot(runs: list[dict], tokens_per_step: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on the CPU box
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run, color in zip(runs, ("tab:blue", "tab:orange"), strict=False):
        label = f"{run['config']} ({run['active'] / 1e6:.2f}M active / {run['total'] / 1e6:.2f}M total)"
        ax.plot([s * tokens_per_step for s, _ in run["train"]], [v for _, v in run["train"]], color=color,
                alpha=0.45, label=f"{label}, train")
        ax.plot([s * tokens_per_step for s, _ in run["eval"]], [v for _, v in run["eval"]], color=color, marker="o",
                label=f"{label}, eval")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("MoE vs dense at equal active parameters (CPU fp32, same data and seed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def table_rows(dense: dict, moe: dict, tokens_per_step: int) -> list[list[str]]:
    """One row per eval: tokens seen, each model's eval loss, the lower in bold."""
    rows = []
    for (step, d), (_, m) in zip(dense["eval"], moe["eval"], strict=True):
        cells = [f"{d:.3f}", f"{m:.3f}"]
        if d != m:
            lower = 0 if d < m else 1
            cells[lower] = f"**{cells[lower]}**"
        rows.append([f"{step * tokens_per_step:,}", *cells])
    return rows


def outcome(dense: dict, moe: dict, tokens_per_step: int) -> str:
    """Where the MoE run first ends an eval below the dense one, and how far apart they end."""
    ahead = [step for (step, d), (_, m) in zip(dense["eval"], moe["eval"], strict=True) if m < d]
    diff = moe["eval"][-1][1] - dense["eval"][-1][1]
    first = (f"{moe['config']} is first below {dense['config']} at {ahead[0] * tokens_per_step:,} tokens; " if ahead
             else f"{moe['config']} stays above {dense['config']}; ")
    side = "lower" if diff < 0 else "higher"
    return f"{first}it ends {abs(diff):.3f} nats {side} at {dense['eval'][-1][0] * tokens_per_step:,} tokens."


def write(path: Path, machine: str, runs: list[dict], tokens_per_step: int, args: argparse.Namespace) -> dict:
    dense, moe = runs
    image = {"image": args.png.name, "image_alt": f"{moe['config']} vs {dense['config']} loss against tokens"} \
        if args.png is not None else {}
    return write_table(
        path, machine=machine, page="moe", title="MoE against dense at equal active parameters",
        command="python bench/moe_vs_dense.py (bench/gpu_moe.sh)",
        setup=f"{moe['config']} ({moe['active'] / 1e6:.2f}M active / {moe['total'] / 1e6:.2f}M total) against "
              f"`configs/{dense['config']}.toml` ({dense['active'] / 1e6:.2f}M), each through `meshformer train` with "
              f"the same data, seed and schedule, {args.steps} steps of {tokens_per_step} tokens "
              f"({dense['seconds']:.0f} s and {moe['seconds']:.0f} s).",
        notes=outcome(dense, moe, tokens_per_step), **image,
        columns=["tokens", f"{dense['config']} eval loss", f"{moe['config']} eval loss"], align=["r", "r", "r"],
        rows=table_rows(dense, moe, tokens_per_step))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--dense", default="tiny-gpt")
    parser.add_argument("--moe", default="tiny-moe")
    parser.add_argument("--set", nargs="*", default=[], help="overrides applied to both runs (e.g. data.batch_size=4)")
    parser.add_argument("--moe-set", nargs="*", default=[], help="overrides for the MoE run only")
    parser.add_argument("--moe-blocks", choices=["tiny-gpt", "config"], default="tiny-gpt",
                        help="the MoE run's blocks: tiny-gpt's (GPT2_BLOCKS, before --set) or its config's own")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrent", action="store_true", help="train both at once (on a shared, busy machine "
                        "both then see the same load; the curves are per token, so timing does not enter them)")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs' temporary folders")
    add_table_arguments(parser)
    args = parser.parse_args()
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)

    from meshformer.config.load import load_config

    base = load_config(ROOT / "configs" / f"{args.dense}.toml", args.set)
    tokens_per_step = base.data.batch_size * base.data.seq_len
    runs = []
    with tempfile.TemporaryDirectory(prefix="moe-vs-dense-", dir=args.work) as tmp:
        started = []
        blocks = GPT2_BLOCKS if args.moe_blocks == "tiny-gpt" else []
        for config, extra in ((args.dense, args.set), (args.moe, [*blocks, *args.set, *args.moe_set])):
            started.append(train(config, args.steps, args.eval_interval, Path(tmp) / config, extra, args.threads))
            if not args.concurrent:
                started[-1] = finish(started[-1])
            started[-1]["total"], started[-1]["active"] = active_params(config, extra)
        for run in started:
            run = run if "train" in run else finish(run)
            runs.append(run)
            print(json.dumps({"bench": "moe_vs_dense", "config": run["config"], "total_params": run["total"],
                              "active_params": run["active"], "tokens_per_step": tokens_per_step,
                              "seconds": round(run["seconds"], 1), "eval": run["eval"], "train": run["train"]}),
                  flush=True)
    if args.png is not None:
        plot(runs, tokens_per_step, args.png)
    dense, moe = runs
    print(f"\n| tokens | {dense['config']} eval loss | {moe['config']} eval loss |\n| ---: | ---: | ---: |")
    for (step, d), (_, m) in zip(dense["eval"], moe["eval"], strict=True):
        print(f"| {step * tokens_per_step:,} | {d:.3f} | {m:.3f} |")
    print(json.dumps({"bench": "moe_vs_dense_summary", "tokens": dense["eval"][-1][0] * tokens_per_step,
                      "dense_eval_loss": dense["eval"][-1][1], "moe_eval_loss": moe["eval"][-1][1],
                      "moe_minus_dense": round(moe["eval"][-1][1] - dense["eval"][-1][1], 4)}))
    if args.table:
        write(args.table, args.machine, runs, tokens_per_step, args)


if __name__ == "__main__":
    main()
