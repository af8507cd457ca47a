"""In-loop downstream evaluation (meshformer/train/downstream.py): its options are checked in one line before step 1,
task files are rendered then by lm-eval in the sandbox, and a request becomes a row of the model's input as lm-eval
cuts it."""

from __future__ import annotations

import json

import pytest

from meshformer.batch import IGNORE_INDEX
from meshformer.config import load_config
from meshformer.data import load_tokenizer
from meshformer.errors import ConfigError
from meshformer.train.downstream import DownstreamEval, check_tasks, padded_length, request_row

DOCS = [{"q": "And God said", "options": ["Let there be light", "banana"], "answer": "Let there be light", "i": 0},
        {"q": "In the beginning ", "options": ["God created", "the end"], "answer": "God created", "i": 0}]


def _task(tmp_path, *lines: str, docs=DOCS):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    yaml = ["task: mine", "dataset_path: json", "dataset_kwargs:", "  data_files:", "    test: docs.jsonl",
            "test_split: test", "output_type: multiple_choice", *lines]
    (tmp_path / "mine.yaml").write_text("\n".join(yaml) + "\n")
    return str(tmp_path / "mine.yaml")


def test_request_row_cuts_from_the_left_and_labels_the_continuation_only():
    assert request_row([1, 2, 3], [4, 5], seq_len=8) == ([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 4, 5])
    # 7 tokens, seq_len 4: the last 5 are kept, as lm-eval keeps the last max_length + 1
    assert request_row([1, 2, 3, 4, 5], [6, 7], seq_len=4) == ([3, 4, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 6, 7])


def test_a_batch_is_as_long_as_its_longest_row_rounded_up_within_seq_len():
    assert padded_length(13, seq_len=64, multiple=8) == 16
    assert padded_length(16, seq_len=64, multiple=8) == 16
    assert padded_length(61, seq_len=64, multiple=24) == 64  # cp=2 x tp=3 x 2 pieces: seq_len already divides


def test_config_checks():
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    with pytest.raises(ConfigError, match="downstream.interval=-1"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:kjv_cloze"]',
                                                      "downstream.interval=-1"]), tok)
    with pytest.raises(ConfigError, match="no bundled task 'bundled:nope'.*bundled:kjv_cloze"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:nope"]']), tok)
    with pytest.raises(ConfigError, match="objective is 'mlm'"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:kjv_cloze"]',
                                                      'model.family="encoder"']), tok)
    with pytest.raises(ConfigError, match="downstream.max_task_mb=0 must be positive"):
        DownstreamEval.from_config(load_config(None, ["downstream.max_task_mb=0"]), tok)
    assert DownstreamEval.from_config(load_config(None, []), tok) is None


@pytest.mark.parametrize(("override", "message"), [
    ("downstream.limit=-1", "must be >= 0"),
    ('downstream.include_path=["/nonexistent/tasks"]', "is not a folder"),
])
def test_bad_options_are_refused_in_one_line(override, message):
    cfg = load_config(None, ['downstream.tasks=["bundled:kjv_lastword"]', override])
    with pytest.raises(ConfigError, match=message):
        check_tasks(cfg)


def test_task_files_are_read_and_rendered_before_step_1(tmp_path):
    check_tasks(load_config(None, ['downstream.tasks=["bundled:kjv_cloze", "bundled:kjv_complete"]']))
    bad = _task(tmp_path, 'doc_to_text: "{{ q.__class__ }}"', "doc_to_choice: options", "doc_to_target: i")
    with pytest.raises(ConfigError, match="reaches Python internals"):
        check_tasks(load_config(None, [f'downstream.tasks=["{bad}"]']))
    # a template that fits the first document but not the second: rendered for every document, named by its line
    docs = [DOCS[0], {k: v for k, v in DOCS[1].items() if k != "answer"}]
    bad = _task(tmp_path, "doc_to_text: q", "doc_to_choice: options", 'doc_to_target: "{{ answer }}"', docs=docs)
    with pytest.raises(ConfigError, match="docs.jsonl line 2: its fields do not fit the task's doc_to_target"):
        check_tasks(load_config(None, [f'downstream.tasks=["{bad}"]']))


def test_row_losses_count_labels_that_are_not_the_argmax():
    import torch

    from meshformer.train.downstream import _RowLosses

    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]], [[0.0, 0.0, 5.0], [1.0, 4.0, 0.0]]])
    labels = torch.tensor([[1, 0], [IGNORE_INDEX, 2]])
    recorder = _RowLosses(lambda lg, lb: torch.zeros(()))
    recorder(logits, labels)
    assert recorder.misses[0].tolist() == [0.0, 1.0]  # row 0 greedy; row 1's one labelled token is not the argmax
