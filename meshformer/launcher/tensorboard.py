"""`meshformer tensorboard RUN_DIR`: serve a run's event files on 127.0.0.1 only (reach it through an SSH tunnel)."""

from __future__ import annotations

import time
from pathlib import Path

from meshformer.errors import MeshformerError

LOOPBACK = "127.0.0.1"  # never every interface: training metrics and text samples stay on this machine


class MonitorError(MeshformerError, RuntimeError):
    """A run folder that cannot be shown, phrased as the problem and its fix."""


def event_files(run_dir: Path) -> list[Path]:
    return sorted(Path(run_dir).rglob("events.out.tfevents.*"))


def existing_run_dir(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MonitorError(f"run folder {run_dir} does not exist; pass a run's logging.run_dir, e.g. runs/tiny-gpt")
    return run_dir


def check_run_dir(run_dir: Path) -> Path:
    run_dir = existing_run_dir(run_dir)
    if not event_files(run_dir):
        raise MonitorError(f"no TensorBoard event files under {run_dir}; was the run trained with "
                           "logging.tensorboard=true (the default), and has it reached its first logging step?")
    return run_dir


def start_tensorboard(run_dir: Path, port: int = 6006) -> str:
    """Start TensorBoard in background threads of this process; returns its URL."""
    from tensorboard import program

    if not 0 <= port <= 65535:
        raise MonitorError(f"--port {port} is not a TCP port", "use a port from 1 to 65535, or 0 for any free port")
    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", str(check_run_dir(run_dir)), "--host", LOOPBACK, "--port", str(port),
                          "--reload_interval", "5", "--load_fast", "false"])
    try:
        return board.launch()
    except program.TensorBoardServerException as err:
        raise MonitorError(f"TensorBoard could not listen on {LOOPBACK}:{port} ({err}); pick another --port") from None


def serve(run_dir: Path, port: int = 6006) -> None:
    url = start_tensorboard(run_dir, port)
    port_used = url.rstrip("/").rsplit(":", 1)[-1]
    print(f"TensorBoard for {run_dir} at {url} (listening on {LOOPBACK} only; from your laptop: "
          f"ssh -L {port_used}:{LOOPBACK}:{port_used} <this host>, then open http://localhost:{port_used}/). "
          "Ctrl-C stops it.", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
