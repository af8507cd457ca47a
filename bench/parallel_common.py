"""Shared pieces of the parallel benchmarks: configs, synthetic batches, spawning a gloo world.

Benchmarks report ratios measured in one run (never absolute timings across runs or machines).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from meshformer.config import Config, config_from_dict  # noqa: E402
from meshformer.model import Transformer  # noqa: E402
from meshformer.parallel import ParallelModel, parallelize  # noqa: E402
from meshformer.parallel_dims import ParallelDims  # noqa: E402
from meshformer.train.loss_choice import resolve_loss  # noqa: E402
from tests.helpers.common import free_port  # noqa: E402


def bench_config(parallel: dict[str, Any] | None = None, *, d_model: int = 256, n_layers: int = 8, seq: int = 128,
                 batch: int = 8, vocab: int = 4096, **train: Any) -> Config:
    raw = {
        "model": {"family": "decoder", "vocab_size": vocab, "d_model": d_model, "n_heads": 8, "d_ff": 4 * d_model,
                  "n_layers": n_layers, "max_seq_len": seq, "position": "rope", "norm": "rmsnorm",
                  "activation": "swiglu", "bias": False, "dropout": 0.0},
        "data": {"seq_len": seq, "batch_size": batch},
        "train": {"device": "cpu", "seed": 0, **train},
        "parallel": parallel or {},
    }
    return config_from_dict(raw)  # validated


def batches(cfg: Config, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.model.vocab_size, (cfg.data.batch_size, cfg.data.seq_len + 1), generator=g)
        out.append({"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()})
    return out


def new_model(cfg: Config) -> Transformer:
    torch.manual_seed(cfg.train.seed)
    return Transformer(cfg.model)


def build_cpu_plan(cfg: Config) -> ParallelModel:
    """`parallelize` on CPU for this world, with the loss the trainer resolves from `cfg`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = resolve_loss(cfg, ParallelDims.from_config(cfg.parallel, world), "cpu")
    return parallelize(new_model(cfg), cfg, torch.device("cpu"), loss)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    result = fn(*args)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def spawn(world: int, fn: Callable, *args: Any, threads: int | None = None) -> list[Any]:
    """Run fn(*args) on `world` gloo processes; returns every rank's result (rank order)."""
    import torch.multiprocessing as mp

    threads = threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(world, free_port(), fn, args, out, threads), nprocs=world,
                           start_method="spawn")
        return json.loads(Path(out).read_text())
