"""The hang watchdog's reports and verdict name a rank's fault-tolerant replica group, and say when it was waiting
for the other groups (fault_tolerance.enabled)."""

from __future__ import annotations

from meshformer.runtime.watchdog import HangWatchdog, explain, read_reports


def test_a_hang_report_names_the_replica_group_and_the_wait_for_the_others(tmp_path):
    for rank, phase in ((0, "forward_backward"), (1, "quorum")):
        watchdog = HangWatchdog(tmp_path, rank=rank, world_size=2, timeout_s=10, replica_group=1)
        watchdog.phase(phase, step=7 - rank)
        watchdog.write_report("no progress")
    folder = tmp_path / "diagnostics"
    message = explain(read_reports(folder), 2, folder, waiting_rank=0)
    assert "collective timeout on replica group 1, rank 0 at step 7" in message, message
    assert "slowest rank: 1 (replica group 1, step 6, phase 'quorum'" in message, message
    assert "replica group 1, rank 1: step 6, phase 'quorum' waiting for the other replica groups" in message, message


def test_without_fault_tolerance_the_report_is_unchanged(tmp_path):
    watchdog = HangWatchdog(tmp_path, rank=0, world_size=1, timeout_s=10)
    watchdog.phase("data", step=3)
    watchdog.write_report("no progress")
    folder = tmp_path / "diagnostics"
    message = explain(read_reports(folder), 1, folder)
    assert "replica group" not in message and "rank 0: step 3, phase 'data'" in message, message
