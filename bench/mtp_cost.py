"""What multi-token prediction costs and what it does to the main loss, on tiny-deepseek (one MTP module).

Step time: in one process, tiny-deepseek with and without its MTP module, forward + backward + AdamW step on the
same (16, 128) batch, rounds alternating after a warm-up round; medians and their ratio (plain cross-entropy on
full logits for both).

Loss: two runs of `meshformer train configs/tiny-deepseek.toml` with the same seed and data, one with MTP and one
with model.mtp.depth=0, each in two phases as DeepSeek-V3 trained: `--phase1` steps at loss_weight 0.3 (constant
lr after warm-up), then resumed to `--steps` at loss_weight 0.1 (the lr decays over the second phase: wsd). A
checkpoint's model config is fixed by a plain resume, so the second phase resumes with checkpoint.load_mode=
"partial", which loads every tensor (they all fit) and takes the new loss weight; the run without MTP resumes the
same way. Compared: `train/loss`, the main next-token loss without the MTP term, at equal tokens, and the held-out
loss.

    python bench/mtp_cost.py [--phase1 75] [--steps 100] [--png docs/benchmarks/img/mtp-loss.png]
                             [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-deepseek.toml"
TOKENS_PER_STEP = 16 * 128  # tiny-deepseek's batch_size x seq_len


def step_times(rounds: int, clock: str = "cpu") -> dict[str, float]:
    """Median seconds of one training step with and without the MTP module (rounds alternating); clock "cpu":
    this process's CPU time, steadier than wall time on a machine other processes load."""
    from meshformer.batch import IGNORE_INDEX
    from meshformer.config import load_config
    from meshformer.model.transformer import Transformer

    sides: dict[str, Any] = {}
    for name, overrides in (("mtp", []), ("no_mtp", ["model.mtp.depth=0"])):
        cfg = load_config(CONFIG, overrides)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        sides[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg.model.mtp.loss_weight)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (16, 129), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    now = time.process_time if clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds + 1):
        for name, (model, optimizer, weight) in sides.items():
            start = now()
            if name == "mtp":
                main, modules = model(inputs, mtp_labels=labels)
                loss = loss_of(main, labels) + weight * sum(loss_of(out, t) for out, t in modules)
            else:
                loss = loss_of(model(inputs), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if r:  # the first round warms up
                times[name].append(now() - start)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def flops_ratio() -> float:
    """Training FLOPs per sequence with the MTP module over without (model/flops.py's count)."""
    from meshformer.config import load_config
    from meshformer.model.flops import training_flops

    with_mtp, without = (load_config(CONFIG, o).model for o in ([], ["model.mtp.depth=0"]))
    return training_flops(with_mtp, 128) / training_flops(without, 128)


def _train(run_dir: Path, overrides: list[str], log: Path, threads: int) -> None:
    cmd = [sys.executable, "-m", "meshformer", "train", str(CONFIG), "--set", f"logging.run_dir={run_dir}",
           "train.sample_interval=0", "train.device=cpu", "logging.tensorboard=false", "logging.log_interval=5",
           *overrides]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with log.open("a") as out:
        done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)},
                              stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"training failed ({done.returncode}); see {log}:\n{log.read_text()[-3000:]}")


def two_phase_run(run_dir: Path, mtp: bool, phase1: int, steps: int, eval_interval: int, threads: int
                  ) -> list[dict[str, Any]]:
    """The run's metrics records: phase 1 at loss_weight 0.3 (constant lr), phase 2 resumed at 0.1 (wsd decay)."""
    depth = [] if mtp else ["model.mtp.depth=0"]
    common = [*depth, f"train.eval_interval={eval_interval}", f"checkpoint.interval={phase1}"]
    log = run_dir / "console.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    _train(run_dir, [*common, f"train.steps={phase1}", "schedule.name=constant", "model.mtp.loss_weight=0.3"], log,
           threads)
    # wsd holds optim.lr until its last decay_fraction of the steps: the decay falls in the second phase only
    decay = f"schedule.decay_fraction={(steps - phase1) / steps}"
    _train(run_dir, [*common, f"train.steps={steps}", "schedule.name=wsd", decay, "model.mtp.loss_weight=0.1",
                     "checkpoint.load_mode=partial"], log, threads)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def curves(records: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """{metric: {tokens seen: value}} of the main train loss, the MTP module's loss and the held-out loss."""
    out: dict[str, dict[int, float]] = {"train/loss": {}, "mtp/loss_1": {}, "eval/loss": {}}
    for record in records:
        for key, curve in out.items():
            if key in record:
                curve[record["step"] * TOKENS_PER_STEP] = record[key]
    return out


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["tokens", "step", "λ", "main loss, MTP", "main loss, no MTP", "difference", "MTP module loss",
               "eval loss, MTP", "eval loss, no MTP"]
    mtp, plain = result["mtp"], result["no_mtp"]
    rows: list[list[Any]] = []
    for tokens in result["report_tokens"]:
        step = tokens // TOKENS_PER_STEP
        a, b = mtp["train/loss"].get(tokens), plain["train/loss"].get(tokens)
        ea, eb = mtp["eval/loss"].get(tokens), plain["eval/loss"].get(tokens)
        module = mtp["mtp/loss_1"].get(tokens)
        rows.append([f"{tokens:,}", step, "0.3" if step <= result["phase1"] else "0.1",
                     "—" if a is None else f"{a:.3f}", "—" if b is None else f"{b:.3f}",
                     "—" if a is None or b is None else f"{a - b:+.3f}", "—" if module is None else f"{module:.3f}",
                     "—" if ea is None else f"{ea:.3f}", "—" if eb is None else f"{eb:.3f}"])
    t = result["step_time"]
    rows.append(["step time", "", "", f"{t['mtp'] * 1e3:.0f} ms", f"{t['no_mtp'] * 1e3:.0f} ms",
                 f"× {t['mtp'] / t['no_mtp']:.2f}", "", "", ""])
    return columns, rows


def plot(result: dict[str, Any], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("mtp", "with MTP: main loss"), ("no_mtp", "without MTP")):
        curve = result[name]["train/loss"]
        ax.plot(list(curve), list(curve.values()), label=label)
    module = result["mtp"]["mtp/loss_1"]
    ax.plot(list(module), list(module.values()), label="with MTP: MTP module's loss", linestyle=":")
    ax.axvline(result["phase1"] * TOKENS_PER_STEP, color="grey", linewidth=0.8)
    ax.set(xlabel="tokens", ylabel="train loss (window mean)", title="tiny-deepseek, λ 0.3 then 0.1")
    ax.set_ylim(top=min(8.5, ax.get_ylim()[1]))
    ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100, bbox_inches="tight")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase1", type=int, default=75, help="steps at loss_weight 0.3")
    parser.add_argument("--steps", type=int, default=100, help="total steps (the rest at loss_weight 0.1)")
    parser.add_argument("--eval-interval", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=7, help="step-time rounds")
    parser.add_argument("--clock", default="cpu", choices=["wall", "cpu"], help="step time: wall or process CPU time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, here and in the training runs "
                        "(1: steadier when other processes share the cores)")
    parser.add_argument("--png", type=Path, help="write the loss curves here (needs matplotlib)")
    add_table_arguments(parser)
    args = parser.parse_args()
    if not 0 < args.phase1 < args.steps:
        raise SystemExit(f"--phase1 {args.phase1} must lie between 0 and --steps {args.steps}")
    torch.set_num_threads(args.threads)
    times = step_times(args.rounds, args.clock)
    print(json.dumps({"bench": "mtp_step_time", "mtp_ms": round(times["mtp"] * 1e3, 1),
                      "no_mtp_ms": round(times["no_mtp"] * 1e3, 1), "ratio": round(times["mtp"] / times["no_mtp"], 3),
                      "rounds": args.rounds, "clock": args.clock, "threads": args.threads,
                      "load_1min": round(os.getloadavg()[0], 2)}), flush=True)
    result: dict[str, Any] = {"step_time": times, "phase1": args.phase1}
    with tempfile.TemporaryDirectory(prefix="mtp_cost_") as tmp:
        for name in ("mtp", "no_mtp"):
            result[name] = curves(two_phase_run(Path(tmp) / name, name == "mtp", args.phase1, args.steps,
                                                args.eval_interval, args.threads))
            print(json.dumps({"bench": "mtp_loss", "run": name, **{k: {str(t): round(v, 4) for t, v in c.items()}
                                                                   for k, c in result[name].items()}}), flush=True)
    evals = sorted(set(result["mtp"]["eval/loss"]) & set(result["no_mtp"]["eval/loss"]))
    result["report_tokens"] = evals or sorted(result["mtp"]["train/loss"])[::5]
    image = plot(result, args.png) if args.png else False
    if args.table:
        columns, rows = table(result)
        extra = {"image": os.path.relpath(args.png, args.table.parent.parent), "image_alt": "train loss against "
                 "tokens, tiny-deepseek with and without MTP"} if image else {}
        write_table(args.table, machine=args.machine, page="architectures",
                    title="Multi-token prediction: step time and main loss at equal tokens",
                    command=f"python bench/mtp_cost.py --phase1 {args.phase1} --steps {args.steps}",
                    setup=(f"tiny-deepseek (2.85M parameters with its MTP module), 16 x 128 tokens per step, fp32, "
                           f"{args.threads} torch thread(s), "
                           f"seed 0, the same data for both runs. Steps 1–{args.phase1} at λ = 0.3 with a constant lr "
                           f"after warm-up, then resumed (checkpoint.load_mode=\"partial\": every tensor loads, the "
                           f"new loss weight applies) to step {args.steps} at λ = 0.1 while the lr decays (wsd); the "
                           "run without MTP resumes the same way. Losses are the logged window means of the main "
                           "next-token loss (`train/loss`, without the MTP term) and the held-out loss. Step time: "
                           "one process, both models alternating, forward + backward + AdamW step on one batch, "
                           "medians of "
                           f"{args.rounds} rounds of this process's {'CPU' if args.clock == 'cpu' else 'wall'} time."),
                    notes=(f"Counted training FLOPs grow × {flops_ratio():.2f} with the module (one more block and "
                           "a second pass through the 4,096-wide output head, which is a large share of so small a "
                           "model). One seed per run: the loss differences are one sample each, with no "
                           "seed-to-seed spread measured."),
                    **extra, columns=columns, rows=rows)


if __name__ == "__main__":
    main()
