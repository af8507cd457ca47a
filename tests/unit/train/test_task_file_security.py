"""A downstream task file is data: its templates cannot run code or read Python internals, its documents come from
regular files inside its folder within a size bound, its YAML cannot expand without bound, and code it names
(`!function`) runs only when the user's own config trusts it (meshformer/eval/task_files.py, task_templates.py).
Each task here is read and rendered as before step 1 (`rendered_docs`: lm-eval's own renderer, with the sandbox as
its template environment)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from meshformer.config.sections import DownstreamConfig
from meshformer.errors import MeshformerError
from meshformer.eval.task_files import MAX_YAML_BYTES, rendered_docs

DOCS = [{"q": "And God said", "options": ["Let there be light", "banana"], "i": 0},
        {"q": "In the beginning ", "options": ["God created", "the end"], "i": 0}]
FIELDS = {"doc_to_text": "q", "doc_to_choice": "options", "doc_to_target": "i"}
TRUSTED = DownstreamConfig(trust_task_code=True)


def _task(folder, docs=DOCS, data_files="docs.jsonl", **fields: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    lines = ["task: mine", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data_files}",
             "test_split: test", "output_type: multiple_choice",
             *(f"{key}: {value}" for key, value in {**FIELDS, **fields}.items())]
    (folder / "mine.yaml").write_text("\n".join(lines) + "\n")
    return str(folder / "mine.yaml")


def _refused(spec: str, options: DownstreamConfig | None = None, *words: str) -> str:
    with pytest.raises(MeshformerError) as info:
        rendered_docs(spec, options or DownstreamConfig())
    line = info.value.one_line()
    assert "\n" not in line, line
    for word in words:
        assert word in line, (word, line)
    return line


@pytest.mark.parametrize("key", ["doc_to_text", "doc_to_choice", "doc_to_target"])
@pytest.mark.parametrize("template", [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ joiner.__init__.__globals__.os.popen('touch MARKER').read() }}",
    '{{ "".__class__.__mro__ }}',
    "{{ q['__class__'] }}",
], ids=["cycler", "joiner", "mro", "item"])
def test_a_template_reaching_python_internals_is_refused_before_it_runs(tmp_path, monkeypatch, key, template):
    monkeypatch.chdir(tmp_path)
    spec = _task(tmp_path / "t", **{key: json.dumps(template)})
    line = _refused(spec, None, f"downstream task {spec}: {key} reaches Python internals",
                    "downstream.trust_task_code = true")
    assert not (tmp_path / "MARKER").exists(), line


@pytest.mark.parametrize("template, words", [
    # a name built at render time: the sandbox refuses the access itself
    ("{% set n = '__cla' ~ 'ss__' %}{{ q[n] }}", ["doc_to_text was refused by the task sandbox", "unsafe"]),
    ("{{ q|attr('upper') }}", ["uses the filter 'attr'", "regex_replace"]),
    ("{{ q|format() }}", ["uses the filter 'format'"]),
    ("{{ 'x' * 10**10 }}", ["a repetition of 10,000,000,000 items", "sandbox"]),
    ("{{ 2 ** 100000000 }}", ["a power of 100000000"]),
    ("{{ (q * 1000)|replace('', q * 1000) }}", ["a replacement building over"]),
    ("{{ (q * 1000).replace('', q * 1000) }}", ["a replacement building over"]),
    ("{{ (q * 1000)|regex_replace('', q * 1000) }}", ["a replacement building over"]),
    ("{{ range(9999)|join(q * 1000) }}", ["a join building over"]),
    ("{{ 'x' * 100000000 }}", ["a repetition of 100,000,000 items"]),
    ("{{ '%1000000000d' % 1 }}", ["a format width of 1,000,000,000"]),
    ("{{ '{:>1000000000}'.format(q) }}", ["str.format()"]),
    ("{{ q.ljust(1000000000) }}", ["str.ljust() with a size above"]),
    ("{% for i in range(1000000000) %}{% endfor %}", ["range() of 1,000,000,000 items"]),
    ("{% for i in range(9999) %}{{ q * 100 }}{% endfor %}", ["a rendered text over"]),
], ids=["dynamic-name", "attr-filter", "format-filter", "big-repeat", "power", "replace-filter", "replace-method",
        "regex-replace", "join", "repeat", "percent", "str-format", "ljust", "range",
        "long-output"])
def test_the_sandbox_bounds_and_refuses_in_one_line_at_once(tmp_path, template, words):
    spec = _task(tmp_path, doc_to_text=json.dumps(template))
    start = time.perf_counter()
    _refused(spec, None, *words)
    assert time.perf_counter() - start < 2


def test_lm_evals_template_idioms_render_in_the_sandbox(tmp_path):
    """What lm-eval's own task templates use: methods of str and list, its filters, tests, range and regex_replace."""
    docs = [{"q": " And God said ", "options": ["light", "dark"], "label": "B", "labels": ["A", "B"]}]
    text = ("{{ q.strip()|regex_replace('God', 'He') }}{% if q is defined and label is not none %}: "
            "{% for i in range(options|length) %}{{ labels[i] }}. {{ options[i]|trim }} {% endfor %}"
            "{{ options|join(', ')|replace('light', 'LIGHT') }} {{ options|map('string')|list|length }}{% endif %}")
    docs = rendered_docs(_task(tmp_path, docs=docs, doc_to_text=json.dumps(text), doc_to_choice="options",
                               doc_to_target=json.dumps("{{ labels.index(label) }}")))
    assert docs[0]["text"] == "And He said: A. light B. dark LIGHT, dark 2"
    assert docs[0]["target"] == 1


def test_function_needs_trust_and_then_loads_from_the_task_folder(tmp_path, monkeypatch):
    """`!function utils.f` as lm-eval reads it (utils.py beside the YAML), only with downstream.trust_task_code."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "t"
    spec = _task(folder, doc_to_text="!function utils.text", process_docs="!function utils.process_docs")
    (folder / "utils.py").write_text(
        "open('IMPORTED', 'w').close()\n"
        "def text(doc):\n    return 'Q: ' + doc['q']\n"
        "def process_docs(dataset):\n    return dataset.map(lambda d: {'q': d['q'].upper()})\n")
    _refused(spec, None, "doc_to_text is !function utils.text", "downstream.trust_task_code = true")
    assert not (tmp_path / "IMPORTED").exists()
    assert [d["text"] for d in rendered_docs(spec, TRUSTED)] == ["Q: AND GOD SAID", "Q: IN THE BEGINNING "]
    assert (tmp_path / "IMPORTED").exists()
    # code outside the task's folder, a missing function: one line each
    (tmp_path / "evil.py").write_text("open('EVIL', 'w').close()\n")
    _refused(_task(folder, doc_to_text="!function ../evil.text"), TRUSTED, "leaves its folder")
    _refused(_task(folder, doc_to_text="!function utils.nothing"), TRUSTED, "has no function 'nothing'")
    assert not (tmp_path / "EVIL").exists()


def test_a_trusted_task_renders_as_lm_eval_does(tmp_path):
    spec = _task(tmp_path, doc_to_text=json.dumps("{{ q.__class__.__name__ }}"))
    assert rendered_docs(spec, TRUSTED)[0]["text"] == "str"


def test_data_files_stay_inside_the_task_folder(tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(DOCS[0]) + "\n")
    folder = tmp_path / "t"
    for name in ("/etc/passwd", str(outside), "../outside.jsonl", "sub/../../outside.jsonl"):
        _refused(_task(folder, data_files=json.dumps(name)), None, "dataset_kwargs.data_files names",
                 "relative to it (not to the current folder")
    (folder / "linked.jsonl").symlink_to(outside)
    spec = _task(folder, data_files="linked.jsonl")
    _refused(spec, None, f"resolves outside {folder}", "downstream.follow_links = true")
    assert len(rendered_docs(spec, DownstreamConfig(follow_links=True))) == 1


def test_a_data_file_that_is_not_a_regular_file_says_what_it_is(tmp_path):
    folder = tmp_path / "t"
    spec = _task(folder, data_files="pipe.jsonl")
    os.mkfifo(folder / "pipe.jsonl")
    _refused(spec, None, "data file", "pipe.jsonl is a FIFO (named pipe), not a regular file")
    (folder / "dir.jsonl").mkdir()
    _refused(_task(folder, data_files="dir.jsonl"), None, "dir.jsonl is a folder, not a regular file")


def test_a_huge_task_jsonl_is_refused_by_size_before_reading(tmp_path):
    folder = tmp_path / "t"
    spec = _task(folder)
    subprocess.run(["truncate", "-s", "6G", str(folder / "docs.jsonl")], check=True)  # sparse: nothing written
    start = time.perf_counter()
    _refused(spec, DownstreamConfig(), "holds 6,442,450,944 bytes, over the limit of 67,108,864",
             "downstream.max_task_mb=64")
    assert time.perf_counter() - start < 1


def test_a_non_utf8_task_jsonl_names_the_file_and_line(tmp_path):
    spec = _task(tmp_path)
    (tmp_path / "docs.jsonl").write_bytes(json.dumps(DOCS[0]).encode() + b'\n{"q": "caf\xe9"}\n')
    _refused(spec, None, "docs.jsonl line 2: not UTF-8 text (byte 0xe9 at column 11)", "UTF-8")


def _bomb(levels: int, merge: bool) -> list[str]:
    lines = ["metadata:", '  a0: &a0 {k: "lol"}' if merge else '  a0: &a0 ["lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        refs = ", ".join([f"*a{i - 1}"] * 9)
        lines.append(f"  a{i}: &a{i} {{<<: [{refs}]}}" if merge else f"  a{i}: &a{i} [{refs}]")
    return lines


@pytest.mark.parametrize("merge", [False, True], ids=["aliases", "merge-keys"])
def test_a_yaml_alias_bomb_is_refused_within_a_second(tmp_path, merge):
    spec = _task(tmp_path)
    text = (tmp_path / "mine.yaml").read_text() + "\n".join(_bomb(12, merge)) + "\n"
    assert len(text) < 1500
    (tmp_path / "mine.yaml").write_text(text)
    start = time.perf_counter()
    _refused(spec, None, "its aliases expand to over 100,000 nodes", "write the values out")
    assert time.perf_counter() - start < 1


def test_a_recursive_alias_a_huge_or_special_task_yaml_is_one_line(tmp_path):
    spec = _task(tmp_path)
    (tmp_path / "mine.yaml").write_text((tmp_path / "mine.yaml").read_text() + "metadata: &a [*a]\n")
    _refused(spec, None, "an alias that holds itself")
    subprocess.run(["truncate", "-s", str(MAX_YAML_BYTES + 1), spec], check=True)
    _refused(spec, None, f"over the limit of {MAX_YAML_BYTES:,}")
    os.mkfifo(tmp_path / "pipe.yaml")
    _refused(str(tmp_path / "pipe.yaml"), None, "pipe.yaml' is a FIFO (named pipe), not a regular file")


@pytest.mark.parametrize("key, value, words", [
    ("include", "_default_template_yaml", ["include is not supported"]),
    ("description", json.dumps("{{ cycler.__init__ }}"), ["description reaches Python internals"]),
    ("target_delimiter", "[1, 2]", ["target_delimiter is [1, 2], not a string"]),
    ("fewshot_delimiter", "{a: 1}", ["fewshot_delimiter is {'a': 1}, not a string"]),
    ("doc_to_text", json.dumps("{{ q"), ["doc_to_text is not a valid template"]),
])
def test_other_keys_of_the_same_kind_are_refused_in_one_line(tmp_path, key, value, words):
    _refused(_task(tmp_path, **{key: value}), None, *words)
