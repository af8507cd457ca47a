"""Hang diagnostics and stragglers on two gloo ranks, through torchrun and the real entry point.

Rank 1 is a data straggler (0.15 s per batch), then stalls for good in the data phase of step 4. Rank 0's
collective times out after parallel.timeout_s: every rank must have written what it was doing, the job must
exit with a message naming rank 1, and TensorBoard must have recorded the straggler before the hang.
"""

from __future__ import annotations

import json

import pytest
from helpers.cluster import CONFIG, finish, overrides, start, worker_env
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from meshformer.cli import main
from meshformer.launcher.torchrun import torchrun_command
from meshformer.runtime.watchdog import explain, slowest_rank

pytestmark = pytest.mark.slow
HANG_STEP = 4


def test_collective_timeout_names_the_slowest_rank_and_every_rank_reports(tmp_path_factory, tmp_path, capsys):
    base, run_dir = tmp_path_factory.getbasetemp(), tmp_path / "run"
    cmd = torchrun_command(CONFIG, overrides(base, run_dir, "parallel.timeout_s=4", "checkpoint.interval=0",
                                             "logging.log_interval=1"), nproc_per_node=2)
    env = worker_env(MF_TEST_SLOW_RANK="1", MF_TEST_SLOW_DATA_S="0.15", MF_TEST_HANG_STEP=str(HANG_STEP),
                     MF_TEST_HANG_S="25")
    log = tmp_path / "torchrun.log"
    (code,) = finish([start(cmd, env, log)], 120)
    text = log.read_text(errors="replace")
    assert code not in (0, -9), f"exit {code}: the job should fail on its own, not hang\n{text[-5000:]}"

    # The job's message names the slowest rank, in the rank's error; the launcher's agent closes with one line, not
    # torchrun's failure report.
    assert "CollectiveTimeoutError: collective timeout on rank 0" in text, text[-5000:]
    assert "slowest rank: 1 (step 4, phase 'data'" in text, text[-5000:]
    assert "Root Cause" not in text and "ChildFailedError" not in text, text[-3000:]
    assert text.rstrip().splitlines()[-1].startswith("error: "), text[-3000:]

    # Every rank wrote what it was waiting on: step, phase, collective.
    reports = {r: json.loads((run_dir / "diagnostics" / f"hang-rank{r}.json").read_text()) for r in (0, 1)}
    waiting, stuck = reports[0], reports[1]
    assert (waiting["step"], waiting["phase"], waiting["reason"]) == (HANG_STEP, "forward_backward",
                                                                     "collective timeout")
    assert waiting["last_collective"]["name"].startswith("gloo:") and "Timed out" in waiting["error"]
    assert (stuck["step"], stuck["phase"]) == (HANG_STEP, "data")
    assert stuck["collectives_issued"] < waiting["collectives_issued"]
    assert any("sleep" in frame or "__iter__" in frame for frame in stuck["stack"])  # where it was stuck
    assert slowest_rank(reports, 2)[0] == 1

    # `meshformer diagnose` gives the same verdict after the job is gone.
    main(["diagnose", str(run_dir)])
    assert "slowest rank: 1" in capsys.readouterr().out

    # Before the hang, TensorBoard recorded the data straggler: rank 1 waits longest for data, every step.
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    worst = [e.value for e in events.Scalars("stragglers/data_wait_max_rank")]
    wait = [e.value for e in events.Scalars("stragglers/data_wait_max_s")]
    assert len(worst) == HANG_STEP - 1 and set(worst) == {1.0}, worst
    assert min(wait) >= 0.15, wait
    tags = set(events.Tags()["scalars"])
    assert {"perf/data_wait_s", "stragglers/step_time_min_s", "stragglers/step_time_max_s",
            "stragglers/step_time_spread_pct", "stragglers/step_time_max_rank"} <= tags


def test_a_rank_without_a_report_is_named_first():
    reports = {0: {"rank": 0, "step": 7, "phase": "forward_backward", "collectives_issued": 90,
                   "seconds_in_phase": 30, "host": "a", "pid": 1, "reason": "collective timeout",
                   "last_collective": {"name": "nccl:all_gather", "sequence": 90}}}
    rank, why = slowest_rank(reports, 2)
    assert rank == 1 and "no report" in why
    assert "slowest rank: 1" in explain(reports, 2, "runs/x/diagnostics", waiting_rank=0)


def test_diagnose_without_reports_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no hang reports"):
        main(["diagnose", str(tmp_path)])
