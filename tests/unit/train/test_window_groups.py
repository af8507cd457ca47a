"""The groups of a local_sgd / DiLoCo window in checkpoints (`ft_window`): what a resume inside the window records."""

from __future__ import annotations

import json
from types import SimpleNamespace

from meshformer.checkpointing.train_state import SchedulerState, optional
from meshformer.runtime.fault_tolerance import StepSync
from meshformer.train.replica_step import WindowGroups


def test_the_window_groups_round_trip_through_json_and_may_be_absent():
    saved = SimpleNamespace(last=StepSync((0, 2), 512.0))
    state = json.loads(json.dumps(WindowGroups(saved).state_dict()))  # as trainer_state.json holds it
    assert state == {"replicas": [0, 2]}
    resumed = SimpleNamespace(last=StepSync((1,), 0.0))  # a group starts out naming itself
    WindowGroups(resumed).load_state_dict(state)
    assert resumed.last.replicas == (0, 2)
    # a checkpoint saved before the component existed still resumes; the others stay required
    assert optional(WindowGroups(saved)) and not optional(SchedulerState.__new__(SchedulerState))
