"""torch.profiler traces for a step range, asked for in the config: `--set profile.start_step=100 profile.steps=3`.

Each recording rank writes `<run_dir>/profile/rank<R>.<time>.pt.trace.json` (Chrome trace format): open it in
https://ui.perfetto.dev or chrome://tracing, or in TensorBoard with the torch-tb-profiler plugin
(`tensorboard --logdir <run_dir>/profile`). The profiler is created only for the range, so the other steps
run without its overhead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

from meshformer.config import ProfileConfig

log = logging.getLogger("meshformer")


def _record_every_step(step: int) -> ProfilerAction:
    return ProfilerAction.RECORD  # the trace is written once, when the range ends (stop())


class StepProfiler:
    """Call `step(n)` after every optimizer step n; records steps start_step .. start_step+steps-1."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int = 0) -> None:
        self.cfg, self.rank = cfg, rank
        self.dir = Path(cfg.dir) if cfg.dir else Path(run_dir) / "profile"
        self.enabled = cfg.start_step > 0 and (not cfg.ranks or rank in cfg.ranks)
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self._profiler: profile | None = None
        self.trace_files: list[Path] = []

    def step(self, finished_step: int) -> None:
        """`finished_step` just completed: start recording before `first`, stop after `last`."""
        if not self.enabled:
            return
        if finished_step == self.first - 1 and self._profiler is None:
            self._start()
        elif self._profiler is not None:
            if finished_step >= self.last:
                self.stop()
            else:
                self._profiler.step()  # closes "ProfilerStep#<n>" in the trace and opens the next one

    def _start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._before = set(self.dir.glob("*.pt.trace.json"))
        self._profiler = profile(
            activities=activities,
            record_shapes=self.cfg.record_shapes,
            profile_memory=self.cfg.profile_memory,
            with_stack=self.cfg.with_stack,
            schedule=_record_every_step,  # any schedule makes the profiler mark "ProfilerStep#<n>" ranges
            on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=f"rank{self.rank}"),
        )
        self._profiler.step_num = self.first  # trace ranges are named after the training steps they cover
        self._profiler.__enter__()

    def stop(self) -> None:
        """End the recording (also called when training ends inside the range) and write the trace."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)  # runs on_trace_ready: the trace file is written here
        self.trace_files = sorted(set(self.dir.glob("*.pt.trace.json")) - self._before)
        if self.rank == 0 or self.cfg.ranks:
            top = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
            log.info(f"profile of steps {self.first}-{self.last} (rank {self.rank}) written to "
                     f"{', '.join(str(p) for p in self.trace_files)}; open in https://ui.perfetto.dev\n{top}")
