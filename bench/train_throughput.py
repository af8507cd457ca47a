"""Trainer overhead and MFU: our Trainer against a minimal hand-written loop around the same model.

Both run in this process on the same model config, seed and device, alternating so that machine noise
hits both alike. The reference is a careful nanoGPT-style loop: random windows from an in-memory token
tensor, mean cross-entropy, clipping, fused AdamW, no logging. Prints one JSON line per dtype:

    python bench/train_throughput.py [--config configs/tiny-gpt.toml] [--steps 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from tables import add_table_arguments, write_row

from meshformer.config import load_config
from meshformer.model import Transformer
from meshformer.model.flops import flops_per_token
from meshformer.train.metrics import measure_matmul_flops
from meshformer.train.trainer import Trainer


def reference_loop(cfg, tokens: torch.Tensor, steps: int, autocast_dtype: torch.dtype | None,
                   device: torch.device) -> float:
    """Tokens per second of the hand-written loop."""
    torch.manual_seed(cfg.train.seed)
    model = Transformer(cfg.model).to(device)
    tokens = tokens.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            weight_decay=cfg.optim.weight_decay, fused=True)
    batch, length = cfg.data.batch_size, cfg.data.seq_len
    gen = torch.Generator().manual_seed(0)

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(tokens) - length - 1, (batch,), generator=gen)
        window = torch.stack([tokens[s : s + length + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]  # already on the device: slicing a device tensor

    def step() -> None:
        x, y = get_batch()
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps * batch * length / (time.perf_counter() - start)


def trainer_run(cfg, steps: int) -> float:
    """Tokens per second of `Trainer.fit` over `steps` steps after a 3-step warm-up (setup excluded)."""
    trainer = Trainer(cfg)
    for _ in range(3):
        trainer.train_step()
    trainer.save_final_weights = lambda **_: True  # measure the loop, not the final file write
    cfg.train.steps = trainer.step + steps
    start = time.perf_counter()
    trainer.fit()
    elapsed = time.perf_counter() - start
    if trainer.step != cfg.train.steps:
        raise RuntimeError(f"the trainer ran to step {trainer.step}, not {cfg.train.steps}: the timing is void")
    return steps * cfg.data.batch_size * cfg.data.seq_len / elapsed


SUMMARY = ["`bench/train_throughput.py`", "`Trainer.fit` vs a hand-written nanoGPT-style loop, same model"]


def table_row(records: list[dict]) -> list[str]:
    """training-01-cpu.json's row: the trainer's tokens/s over the loop's, and its MFU, per dtype."""
    ratios = ", ".join(f"{r['dtype']} {r['overhead_ratio']:.3f}×" for r in records)
    mfu = " / ".join(f"{100 * r['trainer_mfu']:.0f}% ({r['dtype']})" for r in records)
    return [*SUMMARY, f"{ratios} of the loop's tokens/s; MFU {mfu} of the measured GEMM rate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny-gpt.toml")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    add_table_arguments(parser)
    args = parser.parse_args()
    records = []
    for dtype in ("fp32", "bf16"):
        # No checkpoints and no resume: every round trains `steps` fresh steps in a folder of its own.
        overrides = [f"train.dtype={dtype}", "train.eval_interval=0", "train.sample_interval=0",
                     f"logging.log_interval={args.steps}", "checkpoint.interval=0", "checkpoint.resume=false"]
        cfg = load_config(args.config, [*overrides, f"logging.run_dir={tempfile.mkdtemp(prefix='bench-')}"])
        if cfg.objective != "causal":
            raise SystemExit("the hand-written reference loop is a causal LM: pass a decoder-only config")
        trainer = Trainer(cfg)
        device = trainer.device
        batches = iter(trainer.train_data)
        stream = torch.cat([next(batches)["input_ids"].flatten() for _ in range(50)])
        autocast = torch.bfloat16 if dtype == "bf16" else None
        ours, ref = [], []
        for _ in range(args.rounds):
            ref.append(reference_loop(cfg, stream, args.steps, autocast, device))
            run_dir = tempfile.mkdtemp(prefix="bench-")
            ours.append(trainer_run(load_config(args.config, [*overrides, f"logging.run_dir={run_dir}"]), args.steps))
        gemm = measure_matmul_flops(device, torch.bfloat16 if autocast else torch.float32, seconds=0.5)
        fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        ours_tps, ref_tps = statistics.median(ours), statistics.median(ref)
        print(f"# {dtype} rounds: trainer {[round(x) for x in ours]}, reference {[round(x) for x in ref]}", flush=True)
        record = {
            "bench": "train_throughput", "config": args.config, "dtype": dtype, "device": str(device),
            "threads": torch.get_num_threads(),
            "trainer_tokens_per_s": round(ours_tps), "reference_tokens_per_s": round(ref_tps),
            "overhead_ratio": round(ours_tps / ref_tps, 3), "goal_ratio": 0.97,
            "gemm_flops": round(gemm), "trainer_mfu": round(fpt * ours_tps / gemm, 4),
            "reference_mfu": round(fpt * ref_tps / gemm, 4),
        }
        records.append(record)
        print(json.dumps(record))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(records))


if __name__ == "__main__":
    main()
