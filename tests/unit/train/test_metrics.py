"""The numbers users read: the MFU ceiling and where it comes from."""

import json
import math
import sys
import types

import pytest
import torch

from meshformer.config import ConfigError, LoggingConfig
from meshformer.train import metrics
from meshformer.train.metrics import FlopsCeiling, peak_flops


def test_mfu_is_not_pinned_at_100_percent_when_the_measured_ceiling_proves_unreliable():
    ceiling = FlopsCeiling(100e9, "measured GEMM")
    assert ceiling.mfu(50e9) == (0.5, None)
    mfu, note = ceiling.mfu(150e9)  # a window beat the start-up measurement (it ran on a loaded machine)
    assert mfu is None and "MFU n/a" in note and "loaded machine" in note and "0.150 TFLOP/s" in note
    assert ceiling.mfu(75e9) == (None, None)  # said once; no MFU against a ceiling that proved wrong


def test_mfu_is_not_shown_when_the_cpu_ceiling_was_measured_on_busy_cores(monkeypatch):
    """The GEMM threads got a fraction of their cores (other processes ran): the figure and every MFU are off."""
    clock = iter([0.0, 0.5])  # process time: 0.5 s of CPU over 1 s of wall time on 2 threads, a 25% share
    wall = iter([0.0, 1.0])
    monkeypatch.setattr(metrics.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: 40e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    ceiling = FlopsCeiling(*peak_flops(torch.device("cpu"), torch.float32))
    assert "MFU not shown" in ceiling.describe() and "2 threads ran 25% of the time" in ceiling.describe()
    assert ceiling.mfu(10e9) == (None, None)


def test_mfu_is_shown_against_a_cpu_ceiling_measured_with_the_cores_to_itself(monkeypatch):
    clock, wall = iter([0.0, 1.9]), iter([0.0, 1.0])
    monkeypatch.setattr(metrics.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(wall))
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: 40e9)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    ceiling = FlopsCeiling(*peak_flops(torch.device("cpu"), torch.float32))
    assert ceiling.describe().startswith("MFU ceiling 0.04 TFLOP/s (measured")
    assert ceiling.mfu(10e9) == (0.25, None)


def _logger(tmp_path, **options):
    return metrics.RunLogger(tmp_path, enabled=True, tensorboard=False, **options)


def test_metrics_jsonl_holds_one_object_per_logged_step(tmp_path):
    logger = _logger(tmp_path)
    logger.scalars(10, {"train/loss": 2.5, "perf/mfu": math.nan})
    logger.scalars(10, {"eval/loss": 2.7})  # evaluation at the same step: the same object
    logger.scalars(20, {"train/loss": 2.0})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 10, "train/loss": 2.5, "perf/mfu": None, "eval/loss": 2.7},
                    {"step": 20, "train/loss": 2.0}]
    again = _logger(tmp_path)  # a resumed run appends
    again.scalars(30, {"train/loss": 1.5})
    again.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_a_resume_drops_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    """Crashed at step 30 after a checkpoint at step 20, the last line cut short: the resumed run logs 30 again."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = metrics.RunLogger(tmp_path, enabled=True, tensorboard=True)
    for step in (10, 20, 30):
        first.scalars(step, {"train/loss": 1.0})
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 40, "train/lo')  # the crash cut this line
    resumed = metrics.RunLogger(tmp_path, enabled=True, tensorboard=True)
    assert resumed.rewind(20) == 2
    resumed.scalars(30, {"train/loss": 0.5})
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [(10, 1.0), (20, 1.0), (30, 0.5)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0), (20, 1.0), (30, 0.5)]


def test_a_fresh_run_writes_one_event_file_and_no_empty_one(tmp_path):
    """The trainer rewinds every run to its start step (0 for a fresh run): no writer is opened twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = metrics.RunLogger(tmp_path, enabled=True, tensorboard=True)
    assert logger.rewind(0) == 0
    logger.scalars(10, {"train/loss": 1.0})
    logger.text(10, "sample", "In the beginning")
    logger.close()
    files = list((tmp_path / "tensorboard").iterdir())
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 1.0)]


def test_wandb_gets_the_same_scalars_offline(tmp_path, monkeypatch):
    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, dict(values)))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    settings = LoggingConfig(wandb=True, wandb_project="proj", wandb_mode="offline")
    logger = _logger(tmp_path, wandb=settings, run_config={"train": {"steps": 3}})
    logger.scalars(1, {"train/loss": 3.0})
    logger.close()
    (_, init_args), log_call, finish = calls
    assert init_args["mode"] == "offline" and init_args["project"] == "proj" and init_args["dir"] == str(tmp_path)
    assert init_args["config"] == {"train": {"steps": 3}}
    assert log_call == ("log", 1, {"train/loss": 3.0}) and finish == ("finish",)
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "train/loss": 3.0}


def test_wandb_without_the_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError) as info:
        _logger(tmp_path, wandb=LoggingConfig(wandb=True))
    assert "meshformer[wandb]" in info.value.one_line() and "logging.wandb=false" in info.value.one_line()


def _failing_wandb(monkeypatch, *, init_fails: bool) -> list:
    """A `wandb` module whose init (or whose run's log) raises as wandb does without a login or a network."""
    class CommError(Exception):
        pass

    calls: list = []

    class FailingRun:
        def log(self, values, step):
            calls.append(("log", step))
            raise CommError("Network error (ConnectionError), entering retry loop.\n  details follow")

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        if init_fails:
            raise CommError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])\n...")
        return FailingRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def test_wandb_that_cannot_start_is_one_line_with_the_fixes(tmp_path, monkeypatch):
    _failing_wandb(monkeypatch, init_fails=True)
    with pytest.raises(ConfigError) as info:
        _logger(tmp_path, wandb=LoggingConfig(wandb=True))
    line = info.value.one_line()
    assert "\n" not in line and "Weights & Biases did not start (logging.wandb_mode=online): CommError: api_key" in line
    assert "wandb login" in line and "logging.wandb_mode=offline" in line and "logging.wandb=false" in line


def test_every_rank_stops_with_rank0s_wandb_error(tmp_path, monkeypatch):
    """Only rank 0 starts W&B; the other ranks learn its failure from a broadcast and stop with the same line,
    instead of waiting in a collective for a rank that has gone."""
    _failing_wandb(monkeypatch, init_fails=True)
    sent: list = []

    def broadcast_object_list(box, src):  # rank 0 sends its box; the others receive what it sent
        assert src == 0
        if sent:
            box[0] = sent[0]
        else:
            sent.append(box[0])

    monkeypatch.setattr(metrics, "dist", types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_world_size=lambda: 2,
        broadcast_object_list=broadcast_object_list), raising=False)
    lines = []
    for rank in (0, 1):
        with pytest.raises(ConfigError) as info:
            metrics.RunLogger(tmp_path, enabled=rank == 0, tensorboard=False, wandb=LoggingConfig(wandb=True))
        lines.append(info.value.one_line())
    assert lines[0] == lines[1] and "Weights & Biases did not start (logging.wandb_mode=online): CommError" in lines[1]


def test_wandb_failing_mid_run_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    calls = _failing_wandb(monkeypatch, init_fails=False)
    logger = _logger(tmp_path, wandb=LoggingConfig(wandb=True))
    with caplog.at_level("WARNING", logger="meshformer"):
        logger.scalars(1, {"train/loss": 3.0})
        logger.scalars(2, {"train/loss": 2.0})
        logger.close()
    assert calls == [("log", 1)]  # no more W&B calls once it failed
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "Weights & Biases stopped logging (CommError: Network error" in warnings[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_current_memory_is_below_the_peak():
    now, peak = metrics.current_memory_gib(torch.device("cpu")), metrics.memory_gib(torch.device("cpu"))
    assert 0 < now <= peak * 1.01


@pytest.mark.parametrize(
    ("dtype", "tf32", "expected", "source"),
    [
        (torch.bfloat16, False, 989e12, "dense bf16"),
        (torch.float32, True, 494.5e12, "TF32 (enabled)"),
        (torch.float32, False, 67e12, "fp32 without TF32"),
    ],
)
def test_gpu_peak_follows_dtype_and_tf32(monkeypatch, dtype, tf32, expected, source):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(metrics, "tf32_enabled", lambda: tf32)
    flops, where, unreliable = peak_flops(torch.device("cuda"), dtype)
    assert flops == expected and source in where and "H100 datasheet" in where and unreliable is None


def test_tf32_enabled_reads_torch_settings():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not metrics.tf32_enabled()
        torch.set_float32_matmul_precision("high")
        assert metrics.tf32_enabled()
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_peak_is_measured_and_says_how():
    flops, where, _ = peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8 and "measured" in where and "best of 5" in where
