"""Host memory of a whole run at 4 ranks: FSDP trains one step and saves its final weights, and no rank's peak
RSS comes near holding the model (bench/scale_memory.py measures the 158M, 8-rank version of this).

Each rank first runs a tiny model through the same path (imports, gloo buffers, data loader), takes its RSS
then as the base, resets its high-water mark and runs a 60M model. FSDP-4 training state (fp32 weights,
gradients, AdamW moments, each 1/4) is 1.0x the fp32 model; measured peak 1.22x. A rank gathering the whole
model at start-up or in the save adds 1x; glibc keeping FSDP's freed buffers (MESHFORMER_MMAP_THRESHOLD=0)
measured 3.3-3.9x. 38 s on the 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from _common import free_port

WORLD = 4
BOUND = 1.5  # peak RSS over the base, in fp32 models
SIZES = {"tiny": {"d_model": 64, "n_heads": 4, "n_layers": 1, "d_ff": 128},
         "mid": {"d_model": 768, "n_heads": 12, "n_layers": 8, "d_ff": 2048}}


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _config(size: str, run_dir: str):
    from meshformer.config import config_from_dict, validate

    cfg = config_from_dict({
        "model": {"family": "decoder", "vocab_size": 4096, "max_seq_len": 64, "position": "rope", "norm": "rmsnorm",
                  "activation": "swiglu", "bias": False, "dropout": 0.0, **SIZES[size]},
        "data": {"corpus": "bundled:kjv", "tokenizer": "bundled:kjv-bpe-4k", "seq_len": 64, "batch_size": 1,
                 "num_workers": 0},
        "train": {"device": "cpu", "steps": 1, "eval_interval": 0, "sample_interval": 0, "seed": 0},
        "checkpoint": {"interval": 0, "max_shard_size": "32MB"},
        "logging": {"run_dir": run_dir, "log_interval": 1, "tensorboard": False},
        "parallel": {"dp_shard": WORLD},
    })
    validate(cfg)
    return cfg


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    import gc

    import torch
    import torch.distributed as dist

    from meshformer.runtime.distributed import init_distributed, shutdown_distributed
    from meshformer.train.trainer import Trainer

    torch.set_num_threads(1)
    init_distributed(_config("tiny", tmp))
    Trainer(_config("tiny", f"{tmp}/tiny"), rank=rank, local_rank=rank).fit()
    gc.collect()
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
    trainer = Trainer(_config("mid", f"{tmp}/mid"), rank=rank, local_rank=rank)
    model_bytes = 4 * sum(p.numel() for p in trainer.model.parameters())
    trainer.fit()
    result = {"rank": rank, "ratio": (_status("VmHWM") - base) / model_bytes, "model_bytes": model_bytes}
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(tmp, "out.json").write_text(json.dumps(gathered))
    shutdown_distributed()


def test_fsdp_run_and_final_save_never_hold_the_model():
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(free_port(), tmp), nprocs=WORLD, start_method="spawn")
        results = json.loads(Path(tmp, "out.json").read_text())
        assert Path(tmp, "mid", "final").is_dir()
    assert results[0]["model_bytes"] > 220 * 2**20
    ratios = [round(r["ratio"], 3) for r in results]
    print("peak RSS over base, in fp32 models, per rank:", ratios)
    assert max(ratios) < BOUND, ratios


def test_host_memory_policy(monkeypatch):
    """Large host tensors are mapped by default only in multi-process CPU runs; the variable overrides it."""
    import pytest

    from meshformer.runtime.host_memory import ENV_MMAP_THRESHOLD, map_large_host_tensors, mmap_threshold

    monkeypatch.delenv(ENV_MMAP_THRESHOLD, raising=False)
    assert mmap_threshold(1) == 0 and mmap_threshold(8) == 2**20
    assert not map_large_host_tensors("cuda", 8) and not map_large_host_tensors("cpu", 1)
    monkeypatch.setenv(ENV_MMAP_THRESHOLD, "0")
    assert mmap_threshold(8) == 0 and not map_large_host_tensors("cpu", 8)
    monkeypatch.setenv(ENV_MMAP_THRESHOLD, "4194304")
    assert mmap_threshold(1) == 4 * 2**20
    monkeypatch.setenv(ENV_MMAP_THRESHOLD, "lots")
    with pytest.raises(ValueError, match="MESHFORMER_MMAP_THRESHOLD='lots' is not a number of bytes"):
        mmap_threshold(8)
