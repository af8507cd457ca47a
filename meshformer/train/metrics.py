"""Run logging: a concise console line, and the same scalars in metrics.jsonl, TensorBoard and (optionally)
Weights & Biases; plus MFU and memory."""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshformer.config import ConfigError, LoggingConfig
from meshformer.data.corpus_base import short

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


# A CPU ceiling is measured while the GEMM's threads run; below this share of their wall time on a core, other
# processes competed for the cores and the figure (and an MFU against it) says more about them than about the CPU.
MIN_CPU_SHARE = 0.75


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str, str | None]:
    """(peak FLOP/s, where the figure came from, why it is unreliable or None): a datasheet figure on known GPUs,
    else a measured GEMM rate (on CPU unreliable when the measuring threads did not have their cores)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (bf16, fp32) in KNOWN_PEAK_FLOPS.items():
            if key in name:
                if dtype == torch.bfloat16:
                    return bf16, f"{key} datasheet, dense bf16", None
                if tf32_enabled():
                    return bf16 / 2, f"{key} datasheet, TF32 (enabled)", None
                return fp32, f"{key} datasheet, fp32 without TF32", None
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    cpu_start, wall_start = time.process_time(), time.perf_counter()  # process time: all of its threads
    flops = measure_matmul_flops(device, dtype, seconds=0.2, trials=5)
    source = f"measured {dtype} 1024x1024 GEMM at start-up, best of 5"
    if threads:
        share = (time.process_time() - cpu_start) / ((time.perf_counter() - wall_start) * threads)
        if share < MIN_CPU_SHARE:
            return flops, source, (f"its {threads} threads ran {100 * share:.0f}% of the time while measuring "
                                   "(other processes were using the cores)")
    return flops, source, None


class FlopsCeiling:
    """The FLOP/s that MFU is relative to. MFU is shown only against a ceiling measured reliably: not when the
    measurement did not have the CPU to itself, nor once a training window beats a measured ceiling (then it was
    measured on a loaded machine). Either is said once, and MFU is n/a from then on (not a made-up figure)."""

    def __init__(self, flops: float, source: str, unreliable: str | None = None) -> None:
        self.flops, self.source, self.unreliable = flops, source, unreliable
        self._said = False

    def describe(self) -> str:
        """The ceiling for the start-up log line."""
        if self.unreliable:
            return f"MFU not shown: the CPU's ceiling ({self.source}) is unreliable: {self.unreliable}"
        return f"MFU ceiling {self.flops / 1e12:.2f} TFLOP/s ({self.source})"

    def mfu(self, achieved_flops: float) -> tuple[float | None, str | None]:
        """(MFU, or None when the ceiling is unreliable; a note the first time a window proves it so)."""
        if self.unreliable is None and achieved_flops <= self.flops:
            return achieved_flops / self.flops, None
        if self.unreliable is None:
            self.unreliable = (f"training ran at {achieved_flops / 1e12:.3f} TFLOP/s, above the {self.source} "
                               f"({self.flops / 1e12:.3f}), which was measured on a loaded machine")
            return None, f"MFU n/a from here on: {self.unreliable}"
        return None, None


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: accelerator allocations, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def current_memory_gib(device: torch.device) -> float:
    """Memory this process holds now: accelerator allocations, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**30
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):  # not Linux: the peak is the best figure there is
        return memory_gib(device)
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock read afterwards covers it (no-op on the CPU)."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


METRICS_FILE = "metrics.jsonl"  # one JSON object per logged step, in every run folder


class RunLogger:
    """Console, metrics.jsonl, TensorBoard and Weights & Biases, active on rank 0 only (other ranks get a silent
    logger). Every sink gets the same scalars; metrics.jsonl gets one object per step (its scalars merged)."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, wandb: LoggingConfig | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        """wandb: the logging settings when logging.wandb is on; run_config: the config W&B shows."""
        self.enabled = enabled
        self.writer: Any = None
        # The writer opens at the first event (or at rewind, with its purge step): a SummaryWriter opened and then
        # reopened for the purge would leave an event file holding nothing but its header.
        self._tb_dir: Path | None = None
        self._purge_step: int | None = None
        self.wandb: Any = None
        self._pending: dict[str, Any] = {}  # the scalars of the step being logged (metrics.jsonl)
        self.jsonl = None
        if wandb is not None:
            self.wandb = _start_wandb_on_rank0(wandb, run_dir, run_config or {}, start=enabled)
        if not enabled:
            return
        self.jsonl = (run_dir / METRICS_FILE).open("a", encoding="utf-8")  # appended across resumes (see rewind)
        if tensorboard:
            tb_dir = run_dir / "tensorboard"
            try:
                tb_dir.mkdir(parents=True, exist_ok=True)
                probe = tb_dir / ".write-test"
                probe.write_text("ok")
                probe.unlink()
            except OSError as err:
                raise ConfigError(f"TensorBoard folder {tb_dir} is not writable ({err}); "
                                   "set logging.run_dir to a writable folder or logging.tensorboard=false") from None
            self._tb_dir = tb_dir

    def rewind(self, step: int) -> int:
        """A run resumed at `step`: what the interrupted run logged after that step is dropped from metrics.jsonl (a
        line cut short by a crash too) and hidden from TensorBoard (its purge_step), so each sink holds one entry per
        step. Returns the number of metrics.jsonl lines dropped."""
        if not self.enabled or self.jsonl is None:
            return 0
        path = Path(self.jsonl.name)
        self.jsonl.close()
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if _logged_by(line, step)]
        dropped = len(lines) - len(kept)
        if dropped:
            partial = path.with_name(path.name + ".partial")
            partial.write_text("".join(kept), encoding="utf-8")
            os.replace(partial, path)
        self.jsonl = path.open("a", encoding="utf-8")
        if self._tb_dir is not None:
            if self.writer is not None:
                self.writer.close()
                self.writer = None
            self._purge_step = step + 1
        return dropped

    def _tensorboard(self) -> Any:
        """The TensorBoard writer (None without TensorBoard), opened at its first event."""
        if self.writer is None and self._tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self._tb_dir), purge_step=self._purge_step)
        return self.writer

    def info(self, message: str) -> None:
        if self.enabled:
            log.info(message)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self._pending and self._pending["step"] != step:
            self.flush()
        self._pending = {"step": step, **self._pending, **values}
        if (writer := self._tensorboard()) is not None:
            for key, value in values.items():
                writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self._to_wandb("log", values, step=step)

    def text(self, step: int, tag: str, value: str) -> None:
        if self.enabled and (writer := self._tensorboard()) is not None:
            writer.add_text(tag, value, step)

    def flush(self) -> None:
        """Write the scalars of the step being logged to metrics.jsonl now."""
        if self.jsonl is not None and self._pending:
            # JSON has no NaN/inf: those are written as null (a diverged loss stays visible as a gap, not a crash)
            row = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in self._pending.items()}
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        self._pending = {}

    def close(self) -> None:
        self.flush()
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        self._tb_dir = None  # nothing reopens it
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
        if self.wandb is not None:
            self._to_wandb("finish")
            self.wandb = None

    def _to_wandb(self, method: str, *args: Any, **kwargs: Any) -> None:
        """A W&B call; one that fails (the network or W&B's service gone mid-run) is said in one line and ends W&B
        logging for this run, not the training: metrics.jsonl and TensorBoard keep every step."""
        try:
            getattr(self.wandb, method)(*args, **kwargs)
        except Exception as err:
            log.warning("Weights & Biases stopped logging (%s: %s); the run goes on, metrics.jsonl and TensorBoard "
                        "keep every step", type(err).__name__, short(err))
            self.wandb = None


def _logged_by(line: str, step: int) -> bool:
    """Whether a metrics.jsonl line is whole and of a step up to `step`."""
    try:
        return line.endswith("\n") and json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
        return False


def _start_wandb_on_rank0(settings: LoggingConfig, run_dir: Path, run_config: dict[str, Any], *, start: bool) -> Any:
    """Rank 0 (`start`) starts W&B; in a process group every rank learns whether that failed and stops with the same
    error (printed once, see meshformer.errors), instead of waiting in a collective for a rank that has gone."""
    run, error = None, None
    if start:
        try:
            run = start_wandb(settings, run_dir, run_config)
        except ConfigError as err:
            error = (err.what, err.fix)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise ConfigError(*error)
    return run


def start_wandb(settings: LoggingConfig, run_dir: Path, run_config: dict[str, Any]) -> Any:
    """A Weights & Biases run for logging.wandb=true; offline mode writes under the run folder, no network."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("logging.wandb=true needs Weights & Biases, which is not installed",
                          "pip install 'meshformer[wandb]', or set logging.wandb=false") from None
    run_id = _wandb_id(run_dir)
    try:
        return wandb.init(project=settings.wandb_project, name=run_dir.name, dir=str(run_dir), config=run_config,
                          mode=settings.wandb_mode, resume="allow", id=run_id)
    except Exception as err:  # wandb.errors.* (no login, no network, a bad project), its timeouts and socket errors
        offline = ", or set logging.wandb_mode=offline (no network; `wandb sync` uploads later)" \
            if settings.wandb_mode == "online" else ""
        raise ConfigError(f"Weights & Biases did not start (logging.wandb_mode={settings.wandb_mode}): "
                          f"{type(err).__name__}: {short(err)}",
                          f"run `wandb login` (or set WANDB_API_KEY) and check the network{offline}, or set "
                          "logging.wandb=false") from None


def _wandb_id(run_dir: Path) -> str:
    """One W&B run per run folder, so a resume continues its curves (kept in the run folder)."""
    path = run_dir / "wandb-run-id"
    if path.is_file():
        return path.read_text().strip()
    run_id = os.urandom(6).hex()
    path.write_text(run_id + "\n")
    return run_id


def setup_console_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"%(asctime)s [rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
