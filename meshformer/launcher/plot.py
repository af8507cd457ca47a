"""`meshformer plot RUN_DIR`: a run's loss and throughput curves as PNG files, read from its TensorBoard events.

Writes `<run_dir>/plots/loss.png` (train and eval loss), `throughput.png` (tokens/s and MFU) and
`overview.png` (every panel that has data: loss, lr, gradient norm, throughput, MFU, memory, data wait,
step-time spread, checkpoint save time). A resumed run's repeated steps keep the newest value.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on cluster login nodes
import matplotlib.pyplot as plt

from meshformer.launcher.tensorboard import MonitorError, check_run_dir, event_files
from meshformer.progress import progress

Series = dict[str, tuple[list[int], list[float]]]

PANELS: list[tuple[str, list[str]]] = [
    ("loss", ["train/loss", "eval/loss"]),
    ("learning rate", ["train/lr"]),
    ("gradient norm", ["train/grad_norm"]),
    ("tokens/s", ["perf/tokens_per_s"]),
    ("MFU", ["perf/mfu"]),
    ("memory (GiB)", ["perf/memory_gib"]),
    ("seconds per step", ["perf/step_time_s", "perf/data_wait_s", "stragglers/step_time_max_s"]),
    ("checkpoint save (s)", ["checkpoint/save_s"]),
]


def load_scalars(run_dir: Path) -> Series:
    """Every scalar series of the run (all event files under it), by tag, sorted by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_tag: dict[str, dict[int, float]] = {}
    folders = sorted({path.parent for path in event_files(check_run_dir(run_dir))})
    for folder in progress(folders, total=len(folders), desc="reading events", unit="folder",
                           enabled=len(folders) > 1):
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        for tag in events.Tags()["scalars"]:
            points = by_tag.setdefault(tag, {})
            for event in sorted(events.Scalars(tag), key=lambda e: e.wall_time):
                points[event.step] = event.value  # later writes (a resumed run) win
    return {tag: (sorted(points), [points[s] for s in sorted(points)]) for tag, points in by_tag.items()}


def _draw(axis, series: Series, title: str, tags: list[str]) -> bool:
    drawn = False
    for tag in tags:
        if tag in series:
            steps, values = series[tag]
            axis.plot(steps, values, marker="." if len(steps) < 30 else None, label=tag)
            drawn = True
    if drawn:
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    return drawn


def _figure(path: Path, series: Series, panels: list[tuple[str, list[str]]], columns: int) -> Path | None:
    panels = [(title, tags) for title, tags in panels if any(tag in series for tag in tags)]
    if not panels:
        return None
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, min(columns, len(panels)), figsize=(6 * min(columns, len(panels)), 3.6 * rows),
                             squeeze=False)
    for axis, (title, tags) in zip(axes.flat, panels):
        _draw(axis, series, title, tags)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_run(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Write the PNG files; returns their paths."""
    series = load_scalars(run_dir)
    if "train/loss" not in series:
        raise MonitorError(f"the events under {run_dir} hold no train/loss yet; plot again after the first "
                           "logging step (logging.log_interval)")
    out_dir = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [
        _figure(out_dir / "loss.png", series, [PANELS[0]], 1),
        _figure(out_dir / "throughput.png", series, [PANELS[3], PANELS[4]], 2),
        _figure(out_dir / "overview.png", series, PANELS, 2),
    ]
    return [path for path in written if path is not None]
