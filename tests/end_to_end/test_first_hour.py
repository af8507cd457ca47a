"""A newcomer's first hour, as the README leads it: prepare data and train with the printed hint, one line for a
config that trains but likely not as meant, and the own-data recipe beside the quick-start's run."""

from __future__ import annotations

import re
import shlex

import pytest
from helpers.data import small_corpus

from meshformer.cli import main

SHORT_RUN = ["train.steps=2", "train.eval_interval=0", "train.sample_interval=0", "train.device=cpu",
             "data.num_workers=0", "data.batch_size=2", "logging.tensorboard=false", "checkpoint.interval=0"]


def _hint(out: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith("train with: ")]
    return shlex.split(line.removeprefix("train with: "))


def test_data_prepare_hint_trains_verbatim_in_a_run_folder_of_its_own(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    corpus = small_corpus(tmp_path / "corpus", 12)
    main(["data", "prepare", str(corpus), "--out", "data/mine", "--tokenizer", "train", "--vocab-size", "320",
          "--seq-len", "24", "--quiet"])
    words = _hint(capsys.readouterr().out)
    assert words[:4] == ["meshformer", "train", "tiny-gpt", "--set"]
    assert "model.vocab_size=320" in words and "data.seq_len=24" in words
    main([*words[1:], *SHORT_RUN])  # the hint as printed, made short
    err = capsys.readouterr().err
    assert (tmp_path / "runs" / "mine" / "final").is_dir() and not (tmp_path / "runs" / "tiny-gpt").exists()
    assert "warning: the tokenizer" not in err, err  # the hint sets the vocabulary the tokenizer has


def test_a_tokenizer_smaller_than_the_embedding_and_a_warmup_longer_than_the_run_are_one_line_each(
        tmp_path, capsys):
    main(["train", "tiny-gpt", "--set", *SHORT_RUN, "data.tokenizer=gpt2", "model.vocab_size=60000",
          "schedule.warmup_steps=8", f"logging.run_dir={tmp_path / 'run'}", "data.seq_len=16",
          "train.sample_interval=2", "logging.tensorboard=true"])
    err = capsys.readouterr().err
    lines = err.splitlines()
    # the log speaks the user's language: no Python reprs of paths, objects, dicts or quoted strings
    assert not re.search(r"PosixPath\(|object at 0x|\{'|\| '", err), err
    assert any(re.search(r'\] sample +2 \| "', line) for line in lines), err
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1  # no header-only event file beside it
    vocab = [line for line in lines if "warning: the tokenizer" in line]
    warmup = [line for line in lines if "warning: schedule.warmup_steps=8" in line]
    assert len(vocab) == 1 and "50257 tokens but model.vocab_size=60000" in vocab[0], lines
    assert len(warmup) == 1 and "train.steps=2" in warmup[0] and "25% of optim.lr" in warmup[0], lines
    assert (tmp_path / "run" / "final").is_dir()  # warnings, not errors


@pytest.mark.parametrize("steps_left", [False, True])
def test_the_own_data_recipe_after_the_quick_start_suggests_a_new_run_first(tmp_path, monkeypatch, steps_left):
    """The own-data run of another model, into a folder that already holds a run: refused before step 1, and the
    first suggestion is a run folder of its own (no train.steps would continue another model's checkpoints)."""
    monkeypatch.chdir(tmp_path)
    first = [*SHORT_RUN, "checkpoint.interval=2", "logging.run_dir=runs/tiny-gpt"]
    main(["train", "tiny-gpt", "--set", *first])
    steps = ["train.steps=4"] if steps_left else []
    with pytest.raises(SystemExit) as info:
        main(["train", "tiny-gpt", "--set", *first, "model.vocab_size=8192", "model.n_layers=2", *steps])
    line = str(info.value.code)
    assert "\n" not in line and "model.vocab_size" in line, line
    fix = line.split(" — ", 1)[1]
    assert fix.startswith("pass --new-run"), line
    assert "raise train.steps" not in line, line


def test_the_readme_says_how_long_the_quick_start_trains_and_how_to_shorten_it():
    """The first paragraph's step and token counts are tiny-gpt's, and its shorter run still evaluates, samples and
    checkpoints at its last step."""
    import re

    from helpers.common import ROOT

    from meshformer.config import load_config

    intro = " ".join((ROOT / "README.md").read_text().split("## ")[0].split())
    steps, tokens = re.search(r"(\d+) steps of ([\d,]+) tokens, about \d+ minutes", intro).groups()
    cfg = load_config("tiny-gpt")
    assert int(steps) == cfg.train.steps and int(tokens.replace(",", "")) == cfg.data.batch_size * cfg.data.seq_len
    (shorter,) = re.findall(r"`meshformer train tiny-gpt --set train\.steps=(\d+)`", intro)
    short = load_config("tiny-gpt", [f"train.steps={shorter}"])
    for interval in (short.train.eval_interval, short.train.sample_interval, short.checkpoint.interval):
        assert short.train.steps % interval == 0


def test_a_busy_run_folder_suggests_waiting_only_to_the_run_that_holds_it(tmp_path, monkeypatch):
    """The own-data run into the folder the quick-start is training in: another config, so a folder of its own
    comes first; the same config again (a second launch of that run) is told to wait for it."""
    from meshformer.config import load_config
    from meshformer.runtime.run_lock import run_folder_lock

    monkeypatch.chdir(tmp_path)
    quick_start = [*SHORT_RUN, "logging.run_dir=runs/tiny-gpt"]
    run_dir = tmp_path / "runs" / "tiny-gpt"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(load_config("tiny-gpt", quick_start).to_toml())  # what the holder trains
    with run_folder_lock(run_dir, "logging.run_dir"):
        fixes = []
        for extra in (["model.n_layers=2"], []):
            with pytest.raises(SystemExit) as info:
                main(["train", "tiny-gpt", "--set", *quick_start, *extra])
            assert "is in use by pid" in str(info.value.code)
            fixes.append(str(info.value.code).split(" — ", 1)[1])
    assert fixes[0].startswith("set logging.run_dir to a folder of its own"), fixes
    assert fixes[1].startswith("wait for it to finish"), fixes
