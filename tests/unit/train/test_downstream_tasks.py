"""Downstream task files (lm-evaluation-harness' local-task format): what is read, what is refused in one line, and
how a request becomes a row of the model's input (meshformer/train/downstream.py)."""

from __future__ import annotations

import json

import pytest

from meshformer.batch import IGNORE_INDEX
from meshformer.config import load_config
from meshformer.data import load_tokenizer
from meshformer.errors import ConfigError
from meshformer.eval.task_files import load_task
from meshformer.train.downstream import DownstreamEval, encode_pair, padded_length, request_row, task_scores

DOCS = [{"q": "And God said", "options": ["Let there be light", "banana"], "answer": "Let there be light", "i": 0},
        {"q": "In the beginning ", "options": ["God created", "the end"], "answer": "God created", "i": 0}]


def _task(tmp_path, *lines: str, docs=DOCS):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    yaml = ["task: mine", "dataset_path: json", "dataset_kwargs:", "  data_files:", "    test: docs.jsonl",
            "test_split: test", "output_type: multiple_choice", *lines]
    (tmp_path / "mine.yaml").write_text("\n".join(yaml) + "\n")
    return str(tmp_path / "mine.yaml")


@pytest.mark.parametrize("name", ["kjv_cloze", "kjv_next"])
def test_bundled_tasks_read(name):
    task = load_task(f"bundled:{name}")
    assert task.name == name and len(task.docs) == 40 and task.target_delimiter == " "
    assert all(len(d.choices) == 4 and 0 <= d.gold < 4 and d.context for d in task.docs)
    assert len({d.gold for d in task.docs}) > 1  # the answer is not always in one place


@pytest.mark.parametrize("fields", [
    ("doc_to_text: q", "doc_to_choice: options", "doc_to_target: i"),  # column names
    ('doc_to_text: "{{q}}"', 'doc_to_choice: "{{options}}"', 'doc_to_target: "{{answer}}"'),  # templates, text target
    ('doc_to_text: "{{q}}"', 'doc_to_choice: "{{options}}"', 'doc_to_target: "{{i}}"'),  # a digit target: an index
])
def test_columns_templates_and_text_targets(tmp_path, fields):
    task = load_task(_task(tmp_path, *fields))
    assert [(d.context, d.choices, d.gold) for d in task.docs] == [(d["q"], d["options"], 0) for d in DOCS]


def test_an_arc_style_task_reads_as_lm_eval_renders_it(tmp_path):
    docs = [{"question": "Who created the heaven?", "choices": {"text": ["Moses", "God"], "label": ["A", "B"]},
             "answerKey": "B"}]
    task = load_task(_task(tmp_path, 'doc_to_text: "Question: {{question}}\\nAnswer:"',
                           'doc_to_choice: "{{choices.text}}"',
                           'doc_to_target: "{{choices.label.index(answerKey)}}"', docs=docs))
    assert (task.docs[0].context, task.docs[0].choices, task.docs[0].gold) == \
        ("Question: Who created the heaven?\nAnswer:", ["Moses", "God"], 1)


def test_literal_choices_and_a_custom_delimiter(tmp_path):
    task = load_task(_task(tmp_path, 'doc_to_text: "Q: {{q}}\\nA:"', "doc_to_choice: ['yes', 'no']",
                           "doc_to_target: 1", 'target_delimiter: ""'))
    assert task.docs[0].context == "Q: And God said\nA:" and task.docs[0].choices == ["yes", "no"]
    assert task.docs[0].gold == 1 and task.target_delimiter == ""


@pytest.mark.parametrize("lines, words", [
    (("doc_to_text: q", "doc_to_choice: options", "doc_to_target: i", "process_results: !function utils.f"),
     ["'process_results' is not supported", "zero-shot multiple-choice"]),
    (('doc_to_text: !function utils.text', "doc_to_choice: options", "doc_to_target: i"),
     ["doc_to_text is !function utils.text", "downstream.trust_task_code = true"]),
    (("doc_to_text: q", "doc_to_choice: options", "doc_to_target: i", "num_fewshot: 5"),
     ["num_fewshot 5 is not supported", "zero-shot"]),
    (("doc_to_text: q", "doc_to_choice: options", "doc_to_target: q"), ["target 'And God said' is not one of"]),
    (("doc_to_text: q", "doc_to_choice: options", 'doc_to_target: "{{missing}}"'), ["do not fit", "doc_to_*"]),
    (("doc_to_text: q", "doc_to_choice: options"), ["doc_to_target is missing"]),
    (('doc_to_text: "{{i}}"', "doc_to_choice: options", "doc_to_target: i"), ["gives 0", "multiple-input tasks"]),
    (("doc_to_text: q", "doc_to_choice: options", "doc_to_target: 5"), ["target 5 is not a choice index"]),
])
def test_unsupported_or_inconsistent_tasks_are_refused_in_one_line(tmp_path, lines, words):
    with pytest.raises(ConfigError) as info:
        load_task(_task(tmp_path, *lines))
    line = info.value.one_line()
    assert "\n" not in line and "mine" in line
    for word in words:
        assert word in line, (word, line)


def test_other_output_types_and_remote_datasets_are_refused(tmp_path):
    path = _task(tmp_path, "doc_to_text: q", "doc_to_choice: options", "doc_to_target: i")
    text = (tmp_path / "mine.yaml").read_text()
    (tmp_path / "mine.yaml").write_text(text.replace("multiple_choice", "generate_until"))
    with pytest.raises(ConfigError, match="output_type 'generate_until' is not supported"):
        load_task(path)
    (tmp_path / "mine.yaml").write_text(text.replace("dataset_path: json", "dataset_path: allenai/ai2_arc"))
    with pytest.raises(ConfigError, match="dataset_path 'allenai/ai2_arc' is not supported"):
        load_task(path)


def test_a_broken_jsonl_line_is_named(tmp_path):
    path = _task(tmp_path, "doc_to_text: q", "doc_to_choice: options", "doc_to_target: i")
    (tmp_path / "docs.jsonl").write_text(json.dumps(DOCS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match="docs.jsonl line 2: not valid JSON"):
        load_task(path)


def test_encode_pair_moves_the_contexts_trailing_space_and_splits_the_whole_encoding():
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    context, continuation = encode_pair(tok, "In the beginning ", "God created")
    assert context == tok.encode("In the beginning")
    assert context + continuation == tok.encode("In the beginning God created")


def test_request_row_cuts_from_the_left_and_labels_the_continuation_only():
    assert request_row([1, 2, 3], [4, 5], seq_len=8) == ([1, 2, 3, 4], [IGNORE_INDEX, IGNORE_INDEX, 4, 5])
    # 7 tokens, seq_len 4: the last 5 are kept, as lm-eval keeps the last max_length + 1
    assert request_row([1, 2, 3, 4, 5], [6, 7], seq_len=4) == ([3, 4, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 6, 7])


def test_a_batch_is_as_long_as_its_longest_row_rounded_up_within_seq_len():
    assert padded_length(13, seq_len=64, multiple=8) == 16
    assert padded_length(16, seq_len=64, multiple=8) == 16
    assert padded_length(61, seq_len=64, multiple=24) == 64  # cp=2 x tp=3 x 2 pieces: seq_len already divides


def test_acc_norm_divides_by_characters_and_acc_bytes_by_utf8_bytes(tmp_path):
    task = load_task(_task(tmp_path, "doc_to_text: q", "doc_to_choice: ['aé', 'bbb']", "doc_to_target: 0",
                           docs=DOCS[:1]))
    # 'aé' is 2 characters and 3 UTF-8 bytes: per character -1.25 beats -1.33, per byte -0.83 beats -1.33
    scores = task_scores(task, [[-2.5, -4.0]], tokens=[2])
    assert scores["acc"] == 1.0 and scores["acc_norm"] == 1.0 and scores["acc_bytes"] == 1.0
    scores = task_scores(task, [[-2.9, -3.0]], tokens=[2])  # per char -1.45 vs -1.0; per byte -0.97 vs -1.0
    assert scores["acc"] == 1.0 and scores["acc_norm"] == 0.0 and scores["acc_bytes"] == 1.0
    assert scores["loglik_per_token"] == pytest.approx(-2.9 / 2)
    assert scores["loglik_per_byte"] == pytest.approx(-2.9 / len(" aé".encode()))


def test_config_checks(tmp_path):
    tok = load_tokenizer("bundled:kjv-bpe-4k")
    with pytest.raises(ConfigError, match="downstream.interval=-1"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:kjv_cloze"]',
                                                      "downstream.interval=-1"]), tok)
    with pytest.raises(ConfigError, match="no bundled task 'bundled:nope'.*bundled:kjv_cloze"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:nope"]']), tok)
    with pytest.raises(ConfigError, match="objective is 'mlm'"):
        DownstreamEval.from_config(load_config(None, ['downstream.tasks=["bundled:kjv_cloze"]',
                                                      'model.family="encoder"']), tok)
    assert DownstreamEval.from_config(load_config(None, []), tok) is None


@pytest.mark.parametrize(("override", "message"), [
    ('downstream.engine="lm-eval"', "downstream.engine='lm-eval' is not an engine"),
    ("downstream.limit=-1", "must be >= 0"),
    ('downstream.include_path=["/nonexistent/tasks"]', "is not a folder"),
])
def test_lm_eval_engine_refuses_bad_options_in_one_line(override, message):
    from meshformer.train.downstream import check_lm_eval_tasks

    cfg = load_config(None, ['downstream.engine="lm_eval"', 'downstream.tasks=["bundled:kjv_lastword"]', override])
    with pytest.raises(ConfigError, match=message):
        check_lm_eval_tasks(cfg)


def test_lm_eval_engine_reads_task_files_as_the_builtin_engine_does(tmp_path):
    from meshformer.train.downstream import check_lm_eval_tasks

    check_lm_eval_tasks(load_config(None, ['downstream.engine="lm_eval"',
                                           'downstream.tasks=["bundled:kjv_lastword", "bundled:kjv_complete"]']))
    bad = _task(tmp_path, 'doc_to_text: "{{ q.__class__ }}"', "doc_to_choice: options", "doc_to_target: i")
    with pytest.raises(ConfigError):
        check_lm_eval_tasks(load_config(None, ['downstream.engine="lm_eval"', f'downstream.tasks=["{bad}"]']))


def test_row_losses_count_labels_that_are_not_the_argmax():
    import torch

    from meshformer.train.downstream import _RowLosses

    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]], [[0.0, 0.0, 5.0], [1.0, 4.0, 0.0]]])
    labels = torch.tensor([[1, 0], [IGNORE_INDEX, 2]])
    recorder = _RowLosses(lambda lg, lb: torch.zeros(()))
    recorder(logits, labels)
    assert recorder.misses[0].tolist() == [0.0, 1.0]  # row 0 greedy; row 1's one labelled token is not the argmax
