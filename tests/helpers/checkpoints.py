"""Shared pieces of the test_checkpoint_*.py files: tiny data, tiny configs, interrupted runs, launches."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from helpers.common import ROOT, TESTS, free_port
from meshformer.config import Config, load_config

_SHARDS: dict[str, Path] = {}


def tiny_shards(root: Path) -> Path:
    """A few prepared shards of the bundled corpus (made once per session under `root`)."""
    key = str(root)
    if key not in _SHARDS:
        import gzip

        from meshformer.data import prepare
        from meshformer.data.sources import BUNDLED_CORPORA

        out = root / "shards"
        if not (out / "manifest.json").exists():
            corpus = root / "corpus.jsonl"
            with gzip.open(BUNDLED_CORPORA["bundled:kjv"], "rt", encoding="utf-8") as fh:
                docs = [json.loads(line)["text"] for _, line in zip(range(12), fh)]
            corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
            prepare(corpus, out, tokenizer="bundled:kjv-bpe-4k", record_len=33, eval_fraction=0.1, seed=7,
                    shard_records=41, progress=False)
        _SHARDS[key] = out
    return _SHARDS[key]


def tiny_overrides(shards: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        f'data.shards="{shards}"', "data.seq_len=32", "data.batch_size=4", "data.num_workers=0",
        "data.shuffle_shards=2", "model.max_seq_len=32", "model.vocab_size=4096", "model.d_model=32",
        "model.attention.n_heads=2", "model.n_layers=2", "model.ffn.d_ff=64", "model.dropout=0.0",
        f"train.steps={steps}",
        "train.eval_interval=0", "train.sample_interval=0", "train.device=cpu", "schedule.warmup_steps=2",
        "logging.tensorboard=false", "logging.log_interval=1", f'logging.run_dir="{run_dir}"',
        "checkpoint.interval=2", "checkpoint.keep_last=3", *extra,
    ]


def tiny_config(shards: Path, run_dir: Path, steps: int, *extra: str) -> Config:
    return load_config(None, tiny_overrides(shards, run_dir, steps, *extra))


class Crash(Exception):
    """Raised by an interrupted run in place of a real failure."""


def run_trainer(cfg: Config, *, crash_after: int | None = None, sigterm_after: int | None = None,
                rank: int = 0):
    """Train; optionally fail (Crash) before step crash_after+1, or SIGTERM ourselves after step sigterm_after."""
    import signal

    from meshformer.train.trainer import Trainer

    trainer = Trainer(cfg, rank=rank)
    step_fn = trainer.train_step

    def wrapped():
        if crash_after is not None and trainer.step >= crash_after:
            raise Crash(f"crash before step {trainer.step + 1}")
        out = step_fn()
        if sigterm_after is not None and trainer.step == sigterm_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    trainer.train_step = wrapped
    try:
        result = trainer.fit()
    except Crash:
        trainer.checkpoints.close()  # the save in flight finishes, as it would in a process being torn down
        return trainer, None
    return trainer, result


def reference_run(root: Path, steps: int):
    """An uninterrupted run of `steps` steps with blocking saves every 2 steps under `root`:
    (shards, run_dir, trainer, result)."""
    shards = tiny_shards(root)
    run_dir = root / "reference"
    trainer, result = run_trainer(tiny_config(shards, run_dir, steps))
    return shards, run_dir, trainer, result


def reference_files(root: Path, steps: int) -> dict:
    """`reference_run`'s files for a module fixture: root, shards, run_dir and its final weights."""
    shards, run_dir, _, _ = reference_run(root, steps)
    return {"root": root, "shards": shards, "run_dir": run_dir, "weights": final_weights(run_dir)}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "final" / "model.safetensors"))


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"not bitwise equal: {bad[:5]} (max diff {max((a[k] - b[k]).abs().max().item() for k in bad)})"


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def copy_steps(src_root: Path, dst_root: Path, *steps: int) -> Path:
    from meshformer.checkpointing.directory import step_dir_name

    dst_root.mkdir(parents=True, exist_ok=True)
    for step in steps:
        shutil.copytree(src_root / step_dir_name(step), dst_root / step_dir_name(step))
    return dst_root


def launch(script: Path, nproc: int, args: list[str], timeout: float = 120.0) -> list[subprocess.CompletedProcess]:
    """Run `script args` as `nproc` gloo ranks on this machine (what torchrun does, without its start-up cost).

    Returns each rank's result; ranks still running after `timeout` are killed (their returncode is then < 0).
    """
    port = free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""))
    return results
