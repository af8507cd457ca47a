"""`meshformer eval`'s options checked before any work: --set takes the layout's keys only, in one line."""

from __future__ import annotations

import pytest

from meshformer.cli import main


@pytest.mark.parametrize("item", ["model.n_layers=1", "train.steps=3", "parallel.tp"])
def test_set_takes_the_layouts_keys_only(tmp_path, item):
    with pytest.raises(SystemExit) as exit_:
        main(["eval", str(tmp_path), "--tasks", "bundled:kjv_cloze", "--set", item])
    line = str(exit_.value.code)
    assert line.startswith(f"error: --set {item}: meshformer eval takes the layout's keys only")
    assert "parallel.KEY=VALUE" in line and "\n" not in line
