"""Monitoring of one run: TensorBoard scalars/text read back with tensorboard's reader, `meshformer tensorboard`
(served on 127.0.0.1 only), `meshformer plot`, profiler traces of a step range, and an unwritable TensorBoard
folder refused before training starts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.cluster import overrides
from helpers.common import ROOT, free_port
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshformer.cli import main
from meshformer.config import ConfigError, load_config
from meshformer.launcher.plot import load_scalars
from meshformer.train.trainer import Trainer

STEPS = 4
TAGS = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "perf/memory_gib",
        "perf/step_time_s", "perf/data_wait_s", "checkpoint/save_s", "eval/loss", "eval/perplexity"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step run logging every 2 steps, evaluating and sampling at 2 and 4, profiling steps 2-3."""
    base = tmp_path_factory.getbasetemp()
    run_dir = base / "monitored-run"
    cfg = load_config(None, overrides(base, run_dir, f"train.steps={STEPS}", "logging.log_interval=2",
                                      "train.eval_interval=2", "train.eval_batches=2", "train.sample_interval=2",
                                      "train.sample_tokens=8", "checkpoint.interval=2", "profile.start_step=2",
                                      "profile.steps=2"))
    trainer = Trainer(cfg)
    result = trainer.fit()
    return run_dir, result, trainer


def _events(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_holds_every_metric_eval_and_samples(run):
    run_dir, result, _ = run
    events = _events(run_dir)
    assert TAGS <= set(events.Tags()["scalars"]), TAGS - set(events.Tags()["scalars"])
    # The logged numbers are the ones the loop computed (console and TensorBoard agree).
    logged = events.Scalars("train/loss")
    assert [e.step for e in logged] == [h["step"] for h in result.history]
    assert [e.value for e in logged] == pytest.approx([h["train/loss"] for h in result.history])
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
    assert all(math.isfinite(e.value) and e.value > 0 for e in events.Scalars("eval/loss"))
    assert [e.step for e in events.Scalars("checkpoint/save_s")] == [2]  # the final save is not in the loop
    assert 0 < events.Scalars("checkpoint/save_s")[0].value < 60
    assert all(0 <= e.value < 10 for e in events.Scalars("perf/data_wait_s"))
    samples = [e for e in events.Tensors("sample/text_summary")]
    assert [e.step for e in samples] == [2, 4]
    assert all(e.tensor_proto.string_val[0].strip() for e in samples)  # decoded text, not empty


def test_profiler_writes_a_trace_of_the_step_range(run):
    run_dir, _, trainer = run
    traces = sorted((run_dir / "profile").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and traces == trainer.profiler.trace_files
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names  # exactly the requested steps ...
    assert not names & {"ProfilerStep#1", "ProfilerStep#4"}  # ... and no others
    assert any(name.startswith("aten::") for name in names)  # with the operators they ran


def test_plot_writes_loss_and_throughput_pngs(run, capsys):
    run_dir, result, _ = run
    main(["plot", str(run_dir)])
    printed = capsys.readouterr().out
    for name in ("loss.png", "throughput.png", "overview.png"):
        path = run_dir / "plots" / name
        assert f"wrote {path}" in printed
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    steps, losses = load_scalars(run_dir)["train/loss"]
    assert steps == [2, 4] and losses == pytest.approx([h["train/loss"] for h in result.history])


def test_plot_of_a_folder_without_events_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no TensorBoard event files under"):
        main(["plot", str(tmp_path)])


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp*, hex little-endian IPv4)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_tensorboard_serves_the_run_on_loopback_only(run):
    run_dir = run[0]
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "meshformer", "tensorboard", str(run_dir), "--port", str(port)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, tags = time.monotonic() + 60, None
        while tags is None and time.monotonic() < deadline and board.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.loads(r.read())
            except OSError:
                time.sleep(0.5)
        assert tags is not None, board.stdout.read() if board.poll() is not None else "no answer in 60 s"
        assert "train/loss" in tags["tensorboard"] and "eval/loss" in tags["tensorboard"]
        assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and no other interface
    finally:
        board.terminate()
        board.wait(timeout=30)


def test_unwritable_tensorboard_folder_fails_before_training(tmp_path_factory, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("a file where the event folder should be")
    cfg = load_config(None, overrides(tmp_path_factory.getbasetemp(), run_dir))
    with pytest.raises(ConfigError, match=r"TensorBoard folder .*tensorboard is not writable.*logging.run_dir"):
        Trainer(cfg)
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()
