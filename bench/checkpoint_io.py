"""Checkpoint I/O benchmark: save/load throughput against the disk's own sequential bandwidth, measured in the
same run, and the training stall of an async save against a blocking one.

    python bench/checkpoint_io.py [--dir /tmp/ckbench] [--d-model 512] [--layers 8] [--json out.json]

Page cache: every file is fsynced after writing and dropped from the cache (posix_fadvise DONTNEED) before
it is read, for the raw-disk figures and the checkpoint figures alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tables import add_table_arguments, write_row

from meshformer.checkpointing import Checkpointable, CheckpointManager, SchedulerState, TrainState
from meshformer.checkpointing.directory import step_dir_name
from meshformer.config import load_config
from meshformer.model import Transformer

MB = 1 << 20


def drop_cache(path: Path) -> None:
    for root, _, files in os.walk(path) if path.is_dir() else [(path.parent, None, [path.name])]:
        for name in files:
            fd = os.open(Path(root) / name, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bandwidth(folder: Path, size_mb: int) -> tuple[float, float]:
    """Sequential write (with fsync) and cold read, in MB/s, of one file of `size_mb`."""
    path = folder / "raw.bin"
    block = os.urandom(8 * MB)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, size_mb // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = size_mb / (time.perf_counter() - start)
    drop_cache(path)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(8 * MB):
            pass
    read = size_mb / (time.perf_counter() - start)
    path.unlink()
    return write, read


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / MB


def make_trainer(args: argparse.Namespace, root: Path, async_save: bool) -> SimpleNamespace:
    """A model, its AdamW and scheduler, and the `Checkpointable` a save holds (no data loader)."""
    cfg = load_config(None, [f"model.d_model={args.d_model}", f"model.n_layers={args.layers}",
                             f"model.attention.n_heads={max(1, args.d_model // 64)}",
                             f"model.ffn.d_ff={4 * args.d_model}",
                             "model.vocab_size=8192", "model.max_seq_len=128", "checkpoint.interval=1",
                             "checkpoint.keep_last=2", f"checkpoint.async_save={str(async_save).lower()}",
                             "checkpoint.save_on_sigterm=false", f'checkpoint.dir="{root}"'])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    run = Checkpointable(TrainState(), [model], optimizer, {"scheduler": SchedulerState(scheduler)}, cfg)
    return SimpleNamespace(run=run, optimizer=optimizer, scheduler=scheduler, cfg=cfg, model=model)


def train_step(trainer: SimpleNamespace, batch: torch.Tensor) -> None:
    trainer.model(batch).float().logsumexp(-1).mean().backward()
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scheduler.step()
    trainer.run.state.step += 1


def stall(args: argparse.Namespace, root: Path, async_save: bool) -> dict[str, float]:
    """Per save: the time the training loop is blocked in save(), and the whole-loop slowdown (which also counts
    steps slowed by a background write competing for the CPUs and memory bandwidth)."""
    trainer = make_trainer(args, root, async_save)
    manager = CheckpointManager(root, trainer.cfg.checkpoint, log=lambda m: None)
    batch = torch.randint(0, 8192, (args.batch, args.seq))
    train_step(trainer, batch)  # optimizer state exists from here on
    plain = []
    for _ in range(args.save_every):  # the same loop without saves: the baseline
        start = time.perf_counter()
        train_step(trainer, batch)
        plain.append(time.perf_counter() - start)
    base = statistics.median(plain)
    blocked, saves = 0.0, 0
    loop_start = time.perf_counter()
    for i in range(args.steps):
        train_step(trainer, batch)
        if i % args.save_every == args.save_every - 1:
            start = time.perf_counter()
            manager.save(trainer.run)
            blocked += time.perf_counter() - start
            saves += 1
    manager.wait()
    loop = time.perf_counter() - loop_start
    manager.close()
    return {"step_s": base, "blocked_s": blocked / saves, "overhead_s": (loop - args.steps * base) / saves}


SUMMARY = ["`bench/checkpoint_io.py`", "save/load MB/s vs the disk's sequential bandwidth; async vs blocking stall"]


def table_row(results: dict[str, float]) -> list[str]:
    """training-01-cpu.json's row: save and load speed against the disk's, and the time a save blocks training."""
    return [*SUMMARY, f"save {100 * results['save_fraction_of_disk']:.0f}% of disk write, load "
                      f"{100 * results['load_fraction_of_disk']:.0f}% of disk read; stall "
                      f"{results['async_blocked_s']:.2f} s (async) vs {results['blocking_blocked_s']:.2f} s (blocking)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="where to write (default: a temporary folder, removed afterwards)")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=18, help="training steps of each stall measurement")
    parser.add_argument("--save-every", type=int, default=6, help="steps between saves (async saves must not queue)")
    parser.add_argument("--json", help="also write the results here")
    add_table_arguments(parser)
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckbench-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, base)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.table:
        write_row(args.table, machine=args.machine, row=table_row(results))


def run(args: argparse.Namespace, base: Path) -> dict[str, float]:
    trainer = make_trainer(args, base / "save", async_save=False)
    train_step(trainer, torch.randint(0, 8192, (args.batch, args.seq)))
    manager = CheckpointManager(base / "save", trainer.cfg.checkpoint, log=lambda m: None)
    start = time.perf_counter()
    manager.save(trainer.run, blocking=True)
    save_s = time.perf_counter() - start
    folder = base / "save" / step_dir_name(trainer.run.state.step)
    size = folder_mb(folder)
    write_bw, read_bw = disk_bandwidth(base, max(64, int(size)))

    fresh = make_trainer(args, base / "save", async_save=False)
    drop_cache(folder)
    start = time.perf_counter()
    manager.load(folder, fresh.run)
    load_s = time.perf_counter() - start
    manager.close()

    blocking = stall(args, base / "blocking", async_save=False)
    background = stall(args, base / "async", async_save=True)
    results = {
        "checkpoint_mb": size, "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6,
        "disk_write_mb_s": write_bw, "disk_read_mb_s": read_bw,
        "save_mb_s": size / save_s, "save_fraction_of_disk": size / save_s / write_bw,
        "load_mb_s": size / load_s, "load_fraction_of_disk": size / load_s / read_bw,
        "step_s": blocking["step_s"], "blocking_blocked_s": blocking["blocked_s"],
        "async_blocked_s": background["blocked_s"], "blocking_overhead_s": blocking["overhead_s"],
        "async_overhead_s": background["overhead_s"],
    }
    print(f"checkpoint {size:.0f} MB ({results['params_m']:.1f}M parameters + AdamW state), {os.cpu_count()} CPUs")
    print(f"disk       write {write_bw:8.0f} MB/s   read {read_bw:8.0f} MB/s  (sequential, fsync, cold cache)")
    print(f"save       {results['save_mb_s']:8.0f} MB/s = {100 * results['save_fraction_of_disk']:.0f}% of disk write "
          "(DCP write + fsync + sha256 manifest + commit)")
    print(f"load       {results['load_mb_s']:8.0f} MB/s = {100 * results['load_fraction_of_disk']:.0f}% of disk read "
          "(DCP read into the live model and optimizer)")
    print(f"stall      per save, training step {blocking['step_s']:.3f} s: blocked in save() "
          f"{blocking['blocked_s']:.3f} s blocking vs {background['blocked_s']:.3f} s async; whole-loop slowdown "
          f"{blocking['overhead_s']:.3f} s vs {background['overhead_s']:.3f} s")
    return results


if __name__ == "__main__":
    main()
