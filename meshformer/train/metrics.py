"""Run logging: a concise console line and TensorBoard scalars for the same numbers, plus MFU and memory."""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

import torch

from meshformer.config import ConfigError

log = logging.getLogger("meshformer")

# Datasheet dense peaks (FLOP/s) of common accelerators: bf16 tensor cores, and fp32 without tensor cores.
# TF32 tensor cores run fp32 matmuls at half the bf16 rate, but only when TF32 is enabled.
KNOWN_PEAK_FLOPS = {  # name: (bf16, fp32 without TF32)
    "H100": (989e12, 67e12), "H200": (989e12, 67e12), "A100": (312e12, 19.5e12),
    "L40S": (362e12, 91.6e12), "A10G": (125e12, 31.2e12),
}


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.1, trials: int = 3
) -> float:
    """Achieved GEMM FLOP/s on this device and dtype: the ceiling an MFU figure is measured against.

    The best of a few short trials, so a moment of contention (a data worker starting) does not lower it.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(trials):
        synchronize(device)
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        synchronize(device)
        best = max(best, 2 * size**3 * count / (time.perf_counter() - start))
    return best


def tf32_enabled() -> bool:
    """Whether fp32 matmuls may run on TF32 tensor cores (`allow_tf32` follows the matmul precision setting)."""
    return torch.get_float32_matmul_precision() != "highest"


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the figure came from): a datasheet figure on known GPUs, else a measured GEMM rate."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in KNOWN_PEAK_FLOPS.items():
            if key in name:
                if dtype == torch.bfloat16:
                    return bf16, f"{key} datasheet, dense bf16"
                if tf32_enabled():
                    return bf16 / 2, f"{key} datasheet, TF32 (enabled)"
                return fp32, f"{key} datasheet, fp32 without TF32"
    return (measure_matmul_flops(device, dtype, seconds=0.2, trials=5),
            f"measured {dtype} {1024}x{1024} GEMM at start-up, best of 5")


class FlopsCeiling:
    """The FLOP/s that MFU is relative to. MFU never exceeds 100%: a measured ceiling that a training window
    beats (the start-up measurement ran on a loaded machine) is raised to the window's rate, and that is said."""

    def __init__(self, flops: float, source: str) -> None:
        self.flops, self.source = flops, source

    def mfu(self, achieved_flops: float) -> tuple[float, str | None]:
        """(MFU, a note when the ceiling was raised)."""
        if achieved_flops <= self.flops:
            return achieved_flops / self.flops, None
        note = (f"MFU ceiling raised from {self.flops / 1e12:.3f} to {achieved_flops / 1e12:.3f} TFLOP/s: "
                f"training beat the {self.source}, so that measurement was low (a loaded machine)")
        self.flops, self.source = achieved_flops, "highest rate seen in training"
        return 1.0, note


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: accelerator allocations, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read afterwards covers it (no-op on the CPU)."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


class RunLogger:
    """Console + TensorBoard, active on rank 0 only (other ranks get a silent logger)."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = run_dir / "tensorboard"
            try:
                tb_dir.mkdir(parents=True, exist_ok=True)
                probe = tb_dir / ".write-test"
                probe.write_text("ok")
                probe.unlink()
            except OSError as err:
                raise ConfigError(f"TensorBoard folder {tb_dir} is not writable ({err}); "
                                   "set logging.run_dir to a writable folder or logging.tensorboard=false") from None
            self.writer = SummaryWriter(str(tb_dir))

    def info(self, message: str) -> None:
        if self.enabled:
            log.info(message)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def text(self, step: int, tag: str, value: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def setup_console_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
