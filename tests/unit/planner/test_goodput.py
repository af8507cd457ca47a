"""The goodput model of `meshformer plan --failures` (meshformer/planner/goodput.py), against hand computations."""

from __future__ import annotations

import math

import pytest

from meshformer.cli import main
from meshformer.planner.goodput import (
    FAILURES_PER_GPU_S,
    checkpoint_restart_ratio,
    goodput,
    mtbf_s,
    replica_healing_ratio,
    young_daly_interval_s,
)


def test_young_daly_interval_and_ratios_match_a_hand_computation():
    # MTBF 1 h, a 50 s save: tau = sqrt(2 * 50 * 3600) = 600 s; with a 30 s restart and a 50 s load,
    # 1 - 50/600 - (30 + 50 + 300)/3600 = 0.81111
    assert young_daly_interval_s(50, 3600) == pytest.approx(600)
    assert checkpoint_restart_ratio(50, 50, 30, 3600) == pytest.approx(1 - 50 / 600 - 380 / 3600)
    assert checkpoint_restart_ratio(50, 50, 30, 3600) == pytest.approx(0.811111, abs=1e-6)
    # a 3 s pause for everyone and one of 10 groups away for 30 s: 1 - (3 + 3)/3600
    assert replica_healing_ratio(3, 30, 10, 3600) == pytest.approx(0.998333, abs=1e-6)
    assert checkpoint_restart_ratio(600, 600, 600, 600) == 0  # failing faster than it saves: nothing trains


def test_llama3_rate_and_scaling_with_world_size():
    # 419 interruptions in 54 days on 16,384 GPUs: one every 3.09 h there, 16x as long on 1,024
    assert mtbf_s(16384) == pytest.approx(54 * 86400 / 419)
    assert mtbf_s(1024) == pytest.approx(16 * mtbf_s(16384))
    assert FAILURES_PER_GPU_S * 16384 * 54 * 86400 == pytest.approx(419)
    params = 405_000_000_000
    small, large = goodput(params, 1024), goodput(params, 16384)
    assert large.checkpoint_restart < small.checkpoint_restart and large.replica_healing < small.replica_healing
    assert large.replica_healing > large.checkpoint_restart
    # 12 bytes a parameter over 128 nodes at 500 MB/s each; the Young/Daly interval from it and the MTBF
    assert small.save_s == pytest.approx(12 * params / 128 / 500e6)
    assert small.interval_s == pytest.approx(math.sqrt(2 * small.save_s * small.mtbf_s))
    assert small.groups == 128


def test_plan_failures_prints_both_scales_and_the_world(capsys):
    main(["plan", "llama-8b", "--world", "2048", "--failures", "--restart-s", "600"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1,024") or line.startswith("| 2,048")
            or line.startswith("| 16,384")]
    assert len(rows) == 3 and "419 in 54 days" in out and "restart 600.0 s" in out
    expected = goodput(8_030_261_248, 16384, restart_s=600)
    assert f"{expected.checkpoint_restart:.4f}" in rows[-1]
    with pytest.raises(SystemExit, match="^error: --group-gpus 0 makes no replica group"):
        main(["plan", "llama-8b", "--world", "8", "--failures", "--group-gpus", "0"])


@pytest.mark.parametrize("extra", [[], ["--restart-s", "960"]])
def test_the_docs_tables_are_the_commands_output(extra, capsys):
    from helpers.common import ROOT

    main(["plan", "llama-405b", "--world", "16384", "--failures", "--group-gpus", "128", *extra])
    table = "\n".join(capsys.readouterr().out.splitlines()[2:])
    assert table in (ROOT / "docs" / "fault-tolerance.md").read_text()
