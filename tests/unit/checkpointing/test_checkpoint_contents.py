"""What a checkpoint holds (`train_state.saved_contents`): trainer_state.json's "contents", read as "kind" from the
files of earlier releases (tests/fixtures, never edited)."""

from __future__ import annotations

import json

import pytest
from helpers.common import ROOT

from meshformer.checkpointing.train_state import saved_contents

FIXTURES = ROOT / "tests" / "fixtures"


@pytest.mark.parametrize("run", ["run_1ed6c24", "run_e9ebde0_muon"])
def test_a_checkpoint_of_an_earlier_release_holds_training_state(run):
    state = json.loads((FIXTURES / run / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert "contents" not in state and state["kind"] == "training"
    assert saved_contents(state) == "training"


def test_contents_is_read_before_the_old_key():
    assert saved_contents({"contents": "weights"}) == "weights"
    assert saved_contents({"contents": "training", "kind": "weights"}) == "training"
    assert saved_contents({}) is None
