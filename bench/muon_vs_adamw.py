"""Muon against AdamW (issue 37, item 6), in one run so the ratios share a machine state:

(a) optimizer-step time, Muon over AdamW (fused), one process, random gradients, and each step's share of a whole
    training step (forward + backward of `--batch` x seq_len tokens, then the step);
(b) loss against tokens, each optimizer through the real `meshformer train` command (same data, steps, seed),
    and the tokens Muon needs to reach AdamW's final loss (train loss, smoothed over 5 log lines).

Prints one JSON line per measurement and a summary line.

    PYTHONPATH=$PWD python bench/muon_vs_adamw.py --steps 200 --muon-lr 3e-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_vs_dense import ROOT, finish, train
from tables import add_table_arguments, write_table


def step_times(config: str, rounds: int, batch: int, overrides: list[str]) -> dict:
    from meshformer.config.load import load_config
    from meshformer.model import Transformer
    from meshformer.optim import build_optimizer

    cfg = load_config(ROOT / "configs" / f"{config}.toml", overrides)
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len))
    out: dict = {"bench": "muon_step_time", "config": config, "overrides": overrides,
                 "params": sum(p.numel() for p in model.parameters()), "tokens_per_step": batch * cfg.data.seq_len}
    timings = {}
    for name in ("adamw", "muon"):
        cfg.optim.name = name
        cfg.optim.adamw.implementation = "fused"
        optimizer, _ = build_optimizer([model], cfg.optim)
        times, fb = [], []
        for _ in range(rounds + 1):  # the first round creates the state
            t0 = time.perf_counter()
            loss = model(ids).float().logsumexp(-1).mean()
            loss.backward()
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            times.append(t2 - t1)
            fb.append(t1 - t0)
        timings[name] = (statistics.median(times[1:]), statistics.median(fb[1:]))
        out[f"{name}_step_ms"] = 1e3 * timings[name][0]
        out[f"{name}_share_of_training_step"] = timings[name][0] / sum(timings[name])
    out["muon_over_adamw"] = timings["muon"][0] / timings["adamw"][0]
    # Newton–Schulz FLOPs (per iteration on an m x n matrix, m <= n: x·xᵀ 2m²n, gram² 2m³, (·)·x 2m²n) against a
    # training step's 6·params·tokens, at a realistic 0.5M tokens per step
    ns = sum(cfg.optim.muon.ns_steps * (4 * min(p.shape[-2:]) ** 2 * max(p.shape[-2:]) + 2 * min(p.shape[-2:]) ** 3)
             * (p.shape[0] if p.ndim == 3 else 1)
             for group in optimizer.param_groups if group["update"] == "muon" for p in group["params"])
    out["ns_flops_share_at_0.5M_tokens"] = ns / (6 * out["params"] * 2**19)
    return out


def tokens_to_reach(curve: list[tuple[int, float]], target: float, window: int = 5) -> int | None:
    """The first step whose mean loss over the last `window` log lines is at or below `target`."""
    for i in range(window - 1, len(curve)):
        if statistics.mean(v for _, v in curve[i - window + 1:i + 1]) <= target:
            return curve[i][0]
    return None


OPTIMIZERS = {"adamw": "AdamW", "muon": "Muon"}


def kilo(tokens: int) -> str:
    return f"{tokens / 1000:.0f}k"


def eval_rows(curves: dict[str, dict[str, dict]]) -> tuple[list[str], list[list[str]]]:
    """The eval-loss table: a column per eval step (tokens), a row per (config, optimizer)."""
    first = next(iter(curves.values()))
    tokens_per_step = first["adamw"]["tokens_per_step"]
    columns = ["eval at step (tokens)",
               *(f"{step} ({kilo(step * tokens_per_step)})" for step, _ in first["adamw"]["eval"])]
    rows = [[f"{config}, {OPTIMIZERS[name]}", *(f"{loss:.3f}" for _, loss in run["eval"])]
            for config, runs in curves.items() for name, run in runs.items()]
    return columns, rows


def curve_rows(runs: dict[str, dict]) -> list[list[str]]:
    """One config's train loss at every second log line and the last, both optimizers side by side, with the eval
    loss where an eval falls on that step."""
    adamw, muon = runs["adamw"], runs["muon"]
    lines = list(zip(adamw["train"], muon["train"], strict=True))
    shown = lines[1::2] + ([lines[-1]] if len(lines) % 2 else [])
    evals = {name: dict(run["eval"]) for name, run in runs.items()}
    return [[str(step), kilo(step * adamw["tokens_per_step"]), f"{a:.3f}", f"{m:.3f}",
             *(f"{evals[name][step]:.3f}" if step in evals[name] else "" for name in ("adamw", "muon"))]
            for (step, a), (_, m) in shown]


def step_time_note(records: list[dict]) -> str:
    """One process's optimizer-step times, Muon over fused AdamW, per measured shape."""
    shapes = [f"{r['muon_over_adamw']:.1f}× on {r['config']}{' ' + ' '.join(r['overrides']) if r['overrides'] else ''}"
              f" ({r['muon_step_ms']:.0f} vs {r['adamw_step_ms']:.0f} ms, {r['params'] / 1e6:.1f}M parameters; "
              f"{r['muon_share_of_training_step']:.0%} of a {kilo(r['tokens_per_step'])}-token training step)"
              for r in records]
    return f"One process, {torch.get_num_threads()} thread(s): Muon's step takes {', and '.join(shapes)}."


def write_tables(folder: Path, machine: str, curves: dict[str, dict[str, dict]], summaries: dict[str, dict],
                 step_records: list[dict], args: argparse.Namespace) -> None:
    reached = ", ".join(f"step {s['muon_step_reaching_adamw_final']} ({config}: "
                        f"{s['muon_tokens_ratio']:.2f}× the tokens)" if s["muon_step_reaching_adamw_final"] else
                        f"not within the run ({config})" for config, s in summaries.items())
    columns, rows = eval_rows(curves)
    command = f"python bench/muon_vs_adamw.py --config {' '.join(curves)} --table ..."
    write_table(folder / "muon-01-eval.json", machine=machine, page="muon", title="Loss against tokens",
                command=command,
                setup=f"Each optimizer through `meshformer train`, same data, seed and schedule, {args.steps} steps "
                      f"of {args.batch}×128 tokens, `optim.lr = {args.lr}`, `optim.muon.lr = {args.muon_lr}`. Muon "
                      f"reaches AdamW's final train loss (mean of the last 5 log lines) at {reached}. Eval loss:",
                **({"notes": step_time_note(step_records)} if step_records else {}),
                columns=columns, align=["l", *("r" * (len(columns) - 1))], rows=rows)
    for i, (config, runs) in enumerate(curves.items()):
        write_table(folder / f"muon-{i + 2:02d}-{config}.json", machine=machine, page="muon",
                    title=f"{config}, train loss at each log line", command=command,
                    columns=["step", "tokens", "AdamW train", "Muon train", "AdamW eval", "Muon eval"],
                    align=["r"] * 6, rows=curve_rows(runs))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", nargs="+", default=["tiny-gpt", "tiny-moe"],
                        help="configs to train with each optimizer (step times: the first one's shape)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's lr (and the AdamW part's under Muon)")
    parser.add_argument("--muon-lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-step-times", action="store_true")
    parser.add_argument("--small", action="store_true", help="step times of the config's own shape only")
    add_table_arguments(parser, folder=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [[], ["model.d_model=512", "model.attention.n_heads=8", "model.ffn.d_ff=2048", "model.n_layers=8"]]
    step_records = []
    for shape in shapes[:1] if args.small else shapes:
        if not args.skip_step_times:
            step_records.append(step_times(args.config[0], args.rounds, args.batch, shape))
            print(json.dumps(step_records[-1]), flush=True)
    if args.skip_training:
        return
    curves, summaries = {}, {}
    for config in args.config:
        curves[config], summaries[config] = train_both(config, args)
    if args.table:
        write_tables(args.table, args.machine, curves, summaries, step_records, args)


def train_both(config: str, args: argparse.Namespace) -> tuple[dict[str, dict], dict]:
    """Both optimizers' curves on one config, and the summary: where Muon reaches AdamW's final loss."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name in ("adamw", "muon"):
            overrides = [f'optim.name="{name}"', f"optim.lr={args.lr}", f"optim.muon.lr={args.muon_lr}"]
            runs[name] = train(config, args.steps, args.eval_interval, Path(tmp) / name, overrides, args.threads)
        done = {name: finish(run) for name, run in runs.items()}
    tokens_per_step = args.batch * 128
    for name, run in done.items():
        print(json.dumps({"bench": "muon_vs_adamw_curve", "config": config, "optimizer": name, "train": run["train"],
                          "eval": run["eval"], "seconds": run["seconds"]}), flush=True)
    target = statistics.mean(v for _, v in done["adamw"]["train"][-5:])
    reached = tokens_to_reach(done["muon"]["train"], target)
    summary = {"bench": "muon_vs_adamw_summary", "config": config, "adamw_final_train_loss": target,
               "muon_final_train_loss": statistics.mean(v for _, v in done["muon"]["train"][-5:]),
               "adamw_final_eval": done["adamw"]["eval"][-1:], "muon_final_eval": done["muon"]["eval"][-1:],
               "muon_step_reaching_adamw_final": reached, "steps": args.steps,
               "muon_tokens_ratio": None if reached is None else reached / done["adamw"]["train"][-1][0],
               "tokens_per_step": tokens_per_step}
    print(json.dumps(summary), flush=True)
    curves = {name: {"train": run["train"], "eval": run["eval"], "tokens_per_step": tokens_per_step}
              for name, run in done.items()}
    return curves, summary


if __name__ == "__main__":
    main()
