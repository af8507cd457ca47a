"""`meshformer train --replica-groups N` on one machine with GPUs: each group gets GPUs of its own."""

from __future__ import annotations

from meshformer.launcher.replica_groups import group_gpus


def test_each_group_gets_its_own_gpus():
    visible = ["0", "1", "2", "3", "4", "5"]
    assert [group_gpus(r, 2, 3, visible) for r in range(3)] == ["0,1", "2,3", "4,5"]
    # a CUDA_VISIBLE_DEVICES of its own is sliced, not renumbered
    assert [group_gpus(r, 1, 2, ["6", "3"]) for r in range(2)] == ["6", "3"]


def test_fewer_gpus_than_ranks_leave_the_environment_as_it_is():
    assert group_gpus(0, 2, 2, ["0", "1", "2"]) is None
    assert group_gpus(1, 1, 2, []) is None  # a CPU machine
