"""What mHC (manifold-constrained hyper-connections, model.residual.kind = "mhc") costs against the plain residual.

In one process, tiny-deepseek (without its MTP module, which reads one stream) with the plain residual and with mHC
at 4 streams and 20 Sinkhorn iterations: forward + backward + AdamW step on the same (16, 128) batch, rounds
alternating after a warm-up round; medians and their ratio, beside the counted parameters and training FLOPs.

    python bench/mhc_cost.py [--rounds 7] [--streams 4] [--table PATH --machine TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from tables import add_table_arguments, write_table  # noqa: E402

CONFIG = ROOT / "configs" / "tiny-deepseek.toml"
BATCH, SEQ = 16, 128


def sides(streams: int) -> dict[str, list[str]]:
    base = ["model.mtp.depth=0"]
    return {"plain": base, "mhc": [*base, "model.residual.kind=mhc", f"model.residual.streams={streams}"]}


def step_times(streams: int, rounds: int, clock: str = "cpu") -> dict[str, float]:
    """Median seconds of one training step of each side (rounds alternating); clock "cpu": this process's CPU time,
    steadier than wall time on a machine other processes load."""
    from meshformer.config import load_config
    from meshformer.model.transformer import Transformer

    models: dict[str, Any] = {}
    for name, overrides in sides(streams).items():
        cfg = load_config(CONFIG, overrides)
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(0, 4096, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    now = time.process_time if clock == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):
        for name, (model, optimizer) in models.items():
            start = now()
            F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if r:  # the first round warms up
                times[name].append(now() - start)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def counts(streams: int) -> dict[str, dict[str, int]]:
    """Each side's counted parameters and training FLOPs per sequence (model/flops.py)."""
    from meshformer.config import load_config
    from meshformer.model.flops import count_params, training_flops

    out = {}
    for name, overrides in sides(streams).items():
        m = load_config(CONFIG, overrides).model
        out[name] = {"params": count_params(m)["total"], "flops": training_flops(m, SEQ)}
    return out


def ratio(result: dict[str, Any], key: str) -> float:
    c = result["counts"]
    return c["mhc"][key] / c["plain"][key]


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    columns = ["residual", "parameters", "training FLOPs / sequence", "step time", "× plain"]
    t, c = result["step_time"], result["counts"]
    rows = [[name, f"{c[name]['params']:,}", f"{c[name]['flops']:.3g}", f"{t[name] * 1e3:.0f} ms",
             f"× {t[name] / t['plain']:.2f}"] for name in ("plain", "mhc")]
    return columns, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="step-time rounds")
    parser.add_argument("--streams", type=int, default=4, help="mHC's streams (DeepSeek-V4: 4)")
    parser.add_argument("--clock", default="cpu", choices=["wall", "cpu"], help="step time: wall or process CPU time")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on shared cores)")
    add_table_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"step_time": step_times(args.streams, args.rounds, args.clock), "counts": counts(args.streams)}
    t = result["step_time"]
    print(json.dumps({"bench": "mhc_step_time", "plain_ms": round(t["plain"] * 1e3, 1),
                      "mhc_ms": round(t["mhc"] * 1e3, 1), "ratio": round(t["mhc"] / t["plain"], 3),
                      "streams": args.streams, "rounds": args.rounds, "clock": args.clock, "threads": args.threads,
                      "load_1min": round(os.getloadavg()[0], 2)}), flush=True)
    if args.table:
        columns, rows = table(result)
        write_table(args.table, machine=args.machine, page="architectures",
                    title="mHC against the plain residual: step time",
                    command=f"python bench/mhc_cost.py --rounds {args.rounds} --streams {args.streams}",
                    setup=(f"tiny-deepseek without its MTP module, {BATCH} x {SEQ} tokens per step, fp32, "
                           f"{args.threads} torch thread(s); the plain residual against mHC at {args.streams} "
                           "streams and 20 Sinkhorn iterations. One process, both models alternating, forward + "
                           f"backward + AdamW step on one batch, medians of {args.rounds} rounds of this process's "
                           f"{'CPU' if args.clock == 'cpu' else 'wall'} time."),
                    notes=(f"Counted training FLOPs grow × {ratio(result, 'flops'):.2f} (mHC's mixing-weight "
                           "projection and stream mixes); the step time also holds work that FLOP counts leave out: "
                           "the Sinkhorn iterations and the elementwise passes over the n-times wider stream."),
                    columns=columns, rows=rows)


if __name__ == "__main__":
    main()
