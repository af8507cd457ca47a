"""A local copy of the bundled generation task with sampling on, for tests that compare sampled texts."""

from __future__ import annotations

import shutil
from pathlib import Path

SAMPLED = {"do_sample: false": "do_sample: true\n  temperature: 0.9\n  top_k: 50\n  top_p: 0.95"}


def sampled_task(folder: Path) -> str:
    """The bundled `kjv_complete` task as `kjv_sampled` with sampling on: its YAML beside a copy of its documents in
    `folder`; returns the YAML's path."""
    from meshformer.eval.task_files import BUNDLED_DIR

    shutil.copy(BUNDLED_DIR / "kjv_complete.jsonl", folder / "kjv_complete.jsonl")
    text = (BUNDLED_DIR / "kjv_complete.yaml").read_text().replace("task: kjv_complete", "task: kjv_sampled")
    for old, new in SAMPLED.items():
        assert old in text
        text = text.replace(old, new)
    (folder / "kjv_sampled.yaml").write_text(text)
    return str(folder / "kjv_sampled.yaml")
