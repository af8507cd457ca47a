"""Every command the README and the documentation pages show in a bash block runs as shown, in page order, in a
folder holding the inputs the pages name (training runs cut to a few steps), after the files a page shows for the
reader to write (`<!-- file: PATH -->`) are written there; the python blocks a page marks `<!-- run by the tests -->`
run after the page's commands. Commands a page marks with `<!-- not run by the tests: REASON -->` are left out, and
the install and test commands are run by .ci/run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.common import ROOT
from helpers.doc_inputs import write_doc_inputs
from helpers.readme import Shown, is_run_by_ci, shown_commands, shown_files, shown_python

# A training run as shown, cut to a few steps, with a checkpoint at its last step for the commands that convert it.
SHORT_RUN = ["train.steps=3", "logging.log_interval=1", "train.eval_interval=3", "train.eval_batches=1",
             "train.sample_interval=0", "checkpoint.interval=3", "data.num_workers=0"]
# Commands that do not finish on their own, or that report on something the folder does not hold.
SERVES = ("tensorboard",)  # started, checked to be serving, then stopped
NOTHING_TO_REPORT = {"diagnose": "no hang reports"}  # a healthy run has no hang to diagnose: that one line


def _trains(words: list[str]) -> bool:
    return words[1:2] == ["train"] or "meshformer.train" in words


def _as_run(shown: Shown) -> str:
    """The command line to run: a training command cut short (and in a run folder of its own unless it names one),
    a server on any free port."""
    line, words = shown.line, shown.words
    if _trains(words):
        if "--set" in words and any(w.startswith("--") for w in words[words.index("--set") + 1:]):
            raise AssertionError(f"{shown.page}: put --set last in `{shown.line}` (the test appends overrides)")
        line += (" " if "--set" in words else " --set ") + " ".join(SHORT_RUN)
        if words[0] == "meshformer" and "--new-run" not in words:
            line += " --new-run"  # beside the runs of earlier commands, which later commands read
    if words[1:2] == ["tensorboard"]:
        line += " --port 0"
    return line


PAGES = list(dict.fromkeys(s.page for s in shown_commands() if not is_run_by_ci(s)))


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(a folder holding the inputs the pages name, the environment the commands run in): one for all pages, in
    page order, since later pages read what earlier ones wrote (runs/tiny-gpt, hf/tiny-gpt, ...)."""
    root = tmp_path_factory.mktemp("docs")
    folder = root / "user"
    folder.mkdir()
    write_doc_inputs(folder)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, module in (("meshformer", "meshformer"), ("torchrun", "torch.distributed.run")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "MESHFORMER_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "2"}
    return folder, env


def test_the_pages_show_enough_commands_and_say_why_one_is_not_run():
    shown = [s for s in shown_commands() if not is_run_by_ci(s)]
    assert len([s for s in shown if not s.skip]) >= 40, len(shown)
    unknown = [s.line for s in shown if s.words[0] not in ("meshformer", "torchrun", "python", "lm_eval")
               and not s.skip]
    assert unknown == [], unknown
    pages = [ROOT / p for p in PAGES]
    assert sum(len(shown_python(p)) for p in pages) >= 1  # the Python way to load a run's weights
    assert {name for p in pages for name, _ in shown_files(p)} >= {"my_callbacks.py"}


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a page's commands, each starting torch, on a 2-core machine
@pytest.mark.parametrize("page", PAGES)
def test_every_shown_command_runs(page, user_folder):
    folder, env = user_folder
    for name, text in shown_files(ROOT / page):  # the files the page has the reader write, where it says
        assert not Path(name).is_absolute() and ".." not in Path(name).parts, (page, name)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    for s in [s for s in shown_commands() if s.page == page and not is_run_by_ci(s) and not s.skip]:
        line = _as_run(s)
        # `python bench/...` runs in a checkout; `cd DIR && ...` in DIR of the user's folder
        cwd = ROOT if s.words[0] == "python" else folder / s.cwd
        if s.words[1:2] and s.words[1] in SERVES:
            _serves(line, cwd, env, s)
            continue
        out = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        expected = NOTHING_TO_REPORT.get(s.words[1]) if len(s.words) > 1 else None
        if expected and out.returncode == 1:
            assert expected in out.stderr, (line, out.stderr[-2000:])
        else:
            assert out.returncode == 0, (line, out.stdout[-2000:], out.stderr[-3000:])
    for code in shown_python(ROOT / page):
        out = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0, (page, code, out.stdout[-2000:], out.stderr[-3000:])
    if page == PAGES[-1]:
        assert (folder / "runs" / "tiny-gpt" / "final").is_dir()
        assert (folder / "hf" / "tiny-gpt" / "config.json").is_file()


def _serves(line: str, cwd: Path, env: dict[str, str], shown: Shown) -> None:
    proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(20)
        assert proc.poll() is None, (shown.page, line, proc.stdout.read() if proc.stdout else "")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
