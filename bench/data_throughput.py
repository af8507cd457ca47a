"""Loader tokens/s (0, 1, 2 workers) against the tokens/s training consumes (tiny and ~100M model).

    python bench/data_throughput.py                       # configs/tiny-gpt.toml data settings
    python bench/data_throughput.py --objective mlm --batches 300 --json

Trainer consumption is forward + backward + AdamW step of meshformer.model.Transformer on this machine's
device, timed directly (no data loading inside the timing). Goal: loader >= 20x the tiny model's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tables import add_table_arguments, write_row

from meshformer.config import ModelConfig, load_config
from meshformer.data import build_loader, load_tokenizer
from meshformer.model.families import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
HUNDRED_M = dict(d_model=768, n_heads=12, n_layers=14, d_ff=3072)  # ~100M parameters with a 4k vocabulary


def loader_rate(cfg, workers: int, batches: int) -> float:
    cfg.data.num_workers = workers
    loader = build_loader(cfg, load_tokenizer(cfg.data.tokenizer), "train", 0, 1)
    for _ in range(10):  # worker start-up and first shard group
        next(loader)
    start = time.perf_counter()
    for _ in range(batches):
        batch = next(loader)
    elapsed = time.perf_counter() - start
    loader.close()
    return batches * batch["input_ids"].numel() / elapsed


def train_rate(model_cfg: ModelConfig, batch: int, seq_len: int, steps: int, device: str) -> tuple[float, int]:
    from meshformer.model import Transformer

    torch.manual_seed(0)
    model = Transformer(model_cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model_cfg.vocab_size, (batch, seq_len), device=device)

    def step() -> None:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, optimizer state
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    n_params = sum(p.numel() for p in model.parameters())
    return steps * batch * seq_len / (time.perf_counter() - start), n_params


SUMMARY = ["`bench/data_throughput.py`", "loader tokens/s vs what the tiny model consumes"]


def table_row(results: dict[str, float]) -> list[str]:
    """training-01-cpu.json's row: the fastest loader setting over the tiny model's training tokens/s."""
    return [*SUMMARY, f"{results['loader_over_tiny']:.0f}×"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny-gpt.toml"))
    parser.add_argument("--objective", default="causal", choices=["causal", "mlm", "span", "seq2seq"])
    parser.add_argument("--batches", type=int, default=400, help="timed loader batches per worker setting")
    parser.add_argument("--steps", type=int, default=20, help="timed tiny-model steps (the 100M model runs 3)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--skip-100m", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    add_table_arguments(parser)
    args = parser.parse_args()

    family = next(name for name, spec in FAMILIES.items() if args.objective in spec.objectives)  # trains with it
    overrides = [f'train.objective="{args.objective}"', f'model.family="{family}"']
    cfg = load_config(args.config, overrides)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    results: dict[str, float] = {}
    for workers in args.workers:
        results[f"loader_{workers}w_tok_s"] = loader_rate(cfg, workers, args.batches)
    torch.set_num_threads(os.cpu_count() or 1)
    tiny = ModelConfig(**{**vars(cfg.model), "family": "decoder"})
    results["tiny_train_tok_s"], results["tiny_params"] = train_rate(tiny, b, t, args.steps, args.device)
    if not args.skip_100m:
        big = ModelConfig(**{**vars(tiny), **HUNDRED_M, "max_seq_len": max(t, tiny.max_seq_len)})
        results["100m_train_tok_s"], results["100m_params"] = train_rate(big, b, t, 3, args.device)
    best = max(v for k, v in results.items() if k.startswith("loader_"))
    results["loader_over_tiny"] = best / results["tiny_train_tok_s"]
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(results))
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"objective {args.objective}, batch {b} x seq {t}, device {args.device}, {os.cpu_count()} CPU cores")
    for key, value in results.items():
        print(f"  {key:22s} {value:14,.1f}")
    verdict = "meets" if results["loader_over_tiny"] >= 20 else "MISSES"
    print(f"loader / tiny-model consumption = {results['loader_over_tiny']:.1f}x ({verdict} the 20x goal)")


if __name__ == "__main__":
    main()
