"""Peak host memory of a real training run at the largest size this machine allows: a ~150M decoder trains
one step and saves its final weights over 8 gloo ranks (FSDP, TP x FSDP, PP x FSDP), through the trainer.

Reported per layout: the highest peak RSS of any rank over the whole run (start-up, step, save), minus the
same for a tiny model in the same layout (the Python/torch runtime, gloo buffers), over the model's fp32
size. FSDP-8 training state alone (fp32 weights, gradients, AdamW moments, each 1/8) is 0.5 of it; the goal
is <= 0.75. Also the start-up time of the slowest rank (model build: meta build, sharding, materialisation;
and the whole Trainer construction) against one process building the whole model.

    python bench/scale_memory.py [--layouts fsdp tp-fsdp pp-fsdp] [--max-shard-size 32MB] [--mmap-threshold 0]
                                 [--pp-unsharded-microbatches]

Each row also splits the peak by phase (start-up, forward/backward, optimizer step, final save) and says what
the worst rank still held after each. Measured on the 2-core machine (memory ratios; times are noisy there):
FSDP-8 0.75, TP2 x FSDP4 0.54, PP2 x FSDP4 0.75 (1.36 with --pp-unsharded-microbatches, torch's own way); with
--mmap-threshold 0 (glibc's adaptive threshold: freed FSDP buffers stay in its heap) FSDP-8 is 1.31.

Runs one 8-process job at a time; each rank needs under 1 GiB (about 1.2 GiB with the options above).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from parallel_common import free_port  # noqa: E402
from tables import add_table_arguments, write_table  # noqa: E402  (bench/ is on the path when run as a script)

LAYOUTS = {"fsdp": {"dp_shard": 8}, "tp-fsdp": {"tp": 2, "dp_shard": 4}, "pp-fsdp": {"pp": 2, "dp_shard": 4},
           "single": {}}
SIZES = {"150m": {"d_model": 1024, "n_heads": 16, "n_layers": 12, "d_ff": 2816},
         "tiny": {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 256}}


def run_config(size: str, layout: str, run_dir: str, max_shard_size: str, steps: int):
    from meshformer.config import config_from_dict, validate

    raw = {
        "model": {"family": "decoder", "vocab_size": 4096, "max_seq_len": 64, "position": "rope", "norm": "rmsnorm",
                  "activation": "swiglu", "bias": False, "dropout": 0.0, **SIZES[size]},
        "data": {"corpus": "bundled:kjv", "tokenizer": "bundled:kjv-bpe-4k", "seq_len": 64,
                 "batch_size": 2 if "pp" in layout else 1,
                 "num_workers": 0},
        "train": {"device": "cpu", "steps": max(steps, 1), "eval_interval": 0, "sample_interval": 0, "seed": 0},
        "checkpoint": {"interval": 0, "max_shard_size": max_shard_size},
        "logging": {"run_dir": run_dir, "log_interval": 1, "tensorboard": False},
        "parallel": {**LAYOUTS[layout], "pp_microbatches": 2} if "pp" in layout else LAYOUTS[layout],
    }
    cfg = config_from_dict(raw)
    validate(cfg)
    return cfg


def _status_bytes(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


class PhasePeaks:
    """Peak RSS per phase (start-up, forward/backward, optimizer step, final save) and what each phase leaves
    resident. VmHWM is this process's own high-water mark (ru_maxrss would carry the parent's over fork + exec);
    writing 5 to /proc/self/clear_refs resets it to the current RSS, so each phase's peak is its own."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.overall = 0

    def end(self, phase: str) -> None:
        peak = _status_bytes("VmHWM")
        self.overall = max(self.overall, peak)
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)
        self.held[phase] = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")

    def wrap(self, phase: str, func):
        @functools.wraps(func)  # keeps the LR scheduler's mark on optimizer.step
        def wrapped(*args, **kwargs):
            self.end("between")  # data loading, gradient clipping, logging
            try:
                return func(*args, **kwargs)
            finally:
                self.end(phase)
        return wrapped


def worker(rank: int, world: int, port: int, size: str, layout: str, run_dir: str, max_shard_size: str,
           steps: int, out: str, overrides: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    from meshformer.runtime.distributed import init_distributed, shutdown_distributed
    from meshformer.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = run_config(size, layout, run_dir, max_shard_size, steps)
    for key, value in overrides.items():
        setattr(cfg.parallel, key, value)
    phases = PhasePeaks()
    if world > 1:
        init_distributed(cfg)
    start = time.perf_counter()
    trainer = Trainer(cfg, rank=rank, local_rank=rank)
    startup_s = time.perf_counter() - start
    phases.end("startup")
    params = sum(p.numel() for p in trainer.model.parameters()) if trainer.model is not None else None
    trainer.parallel_model.forward_backward = phases.wrap("forward_backward", trainer.parallel_model.forward_backward)
    trainer.optimizer.step = phases.wrap("optimizer_step", trainer.optimizer.step)
    trainer.save_final_weights = phases.wrap("final_save", trainer.save_final_weights)
    if steps:
        trainer.fit()
    phases.end("between")
    result = {"rank": rank, "startup_s": startup_s, "build_s": trainer.build_s, "peak_rss": phases.overall,
              "params": params, "phase_peaks": phases.peaks, "phase_held": phases.held}
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
        shutdown_distributed()
    else:
        Path(out).write_text(json.dumps([result]))


def launch(size: str, layout: str, max_shard_size: str, steps: int = 1, overrides: dict[str, Any] | None = None
           ) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    world = 1 if layout == "single" else 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(worker, args=(world, free_port(), size, layout, os.path.join(tmp, "run"), max_shard_size,
                                         steps, out, overrides or {}), nprocs=world, start_method="spawn")
        return json.loads(Path(out).read_text())


def _param_count(max_shard_size: str) -> int:
    import torch

    from meshformer.model import Transformer

    with torch.device("meta"):
        model = Transformer(run_config("150m", "single", "unused", max_shard_size, 1).model)
    return sum(p.numel() for p in model.parameters())


LAYOUT_NAMES = {"fsdp x8": "FSDP-8", "tp-fsdp x8": "TP2 × FSDP4", "pp-fsdp x8": "PP2 × FSDP4"}
PHASES = {"startup": "start-up", "forward_backward": "forward/backward", "optimizer_step": "optimizer step",
          "final_save": "save"}


def table_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    """One row per layout: the worst rank's peak RSS over the fp32 model, the phase it peaked in, and the other
    phases' peaks in brackets."""
    rows = []
    for r in records:
        phases = {name: r["phase_ratio"][phase] for phase, name in PHASES.items() if phase in r["phase_ratio"]}
        top = max(phases, key=phases.__getitem__)
        others = ", ".join(f"{name} {value:.2f}" for name, value in phases.items() if name != top)
        rows.append([LAYOUT_NAMES.get(r["layout"], r["layout"]), f"{r['ratio']:.2f}", f"{top} ({others})"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "tp-fsdp", "pp-fsdp"], choices=list(LAYOUTS)[:-1])
    parser.add_argument("--max-shard-size", default="32MB", help="final weights' largest file (checkpoint."
                        "max_shard_size)")
    parser.add_argument("--skip-single", action="store_true", help="no one-process start-up reference")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="the ranks' MESHFORMER_MMAP_THRESHOLD (meshformer/runtime/host_memory.py; default: the "
                             "trainer's 1 MiB; 0: glibc's own adaptive threshold, as before the trainer set one)")
    parser.add_argument("--pp-unsharded-microbatches", action="store_true",
                        help="parallel.pp_fsdp_unsharded_microbatches=true: torch's own PP x FSDP behaviour")
    add_table_arguments(parser)
    args = parser.parse_args()
    if args.mmap_threshold is not None:  # the spawned ranks inherit it
        os.environ["MESHFORMER_MMAP_THRESHOLD"] = str(args.mmap_threshold)
    overrides = {"pp_fsdp_unsharded_microbatches": True} if args.pp_unsharded_microbatches else {}
    n_params = None
    single_startup = None
    if not args.skip_single:  # start-up only: one process building and initialising the whole model
        single = launch("150m", "single", args.max_shard_size, steps=0)[0]
        single_startup, n_params = single["build_s"], single["params"]
        print(json.dumps({"layout": "single (start-up only)", "build_s": round(single_startup, 2),
                          "trainer_init_s": round(single["startup_s"], 2), "params_M": round(n_params / 1e6, 1)}),
              flush=True)
    records: list[dict[str, Any]] = []
    for layout in args.layouts:
        tiny = launch("tiny", layout, args.max_shard_size, overrides=overrides)
        big = launch("150m", layout, args.max_shard_size, overrides=overrides)
        n_params = n_params or _param_count(args.max_shard_size)
        model_bytes = 4 * n_params
        base = max(r["peak_rss"] for r in tiny)
        worst = max(big, key=lambda r: r["peak_rss"])
        row = {
            "layout": f"{layout} x8", "params_M": round(n_params / 1e6, 1),
            "fp32_model_GiB": round(model_bytes / 2**30, 3),
            "max_rank_peak_rss_GiB": round(worst["peak_rss"] / 2**30, 3), "worst_rank": worst["rank"],
            "tiny_peak_rss_GiB": round(base / 2**30, 3),
            "ratio": round((worst["peak_rss"] - base) / model_bytes, 3), "goal": "<= 0.75",
            # per phase: the highest peak of any rank in it, and what the worst rank still held after it
            "phase_ratio": {phase: round((max(r["phase_peaks"][phase] for r in big) - base) / model_bytes, 3)
                            for phase in big[0]["phase_peaks"]},
            "held_after_ratio": {phase: round((max(r["phase_held"][phase] for r in big) - base) / model_bytes, 3)
                                 for phase in big[0]["phase_held"]},
            "max_rank_build_s": round(max(r["build_s"] for r in big), 2),
            "max_rank_trainer_init_s": round(max(r["startup_s"] for r in big), 2),
        }
        if single_startup:
            row["build_vs_single"] = round(row["max_rank_build_s"] / single_startup, 2)
        records.append(row)
        print(json.dumps(row), flush=True)
    if args.table:
        write_table(args.table, machine=args.machine, page="parallel", title="Host memory at scale",
                    command="python bench/scale_memory.py",
                    setup=f"Peak RSS per rank of a {(n_params or 0) / 1e6:.0f}M decoder training one step and saving "
                          "its final weights over 8 gloo ranks, less a tiny model's, over the fp32 model (the sharded "
                          "training state alone is 0.5). `tests/end_to_end/test_scale_memory.py` holds FSDP-4 training "
                          "plus the final save under 1.5× the model per rank.",
                    columns=["layout", "peak RSS / model", "peak in"], align=["l", "r", "l"],
                    rows=table_rows(records))


if __name__ == "__main__":
    main()
