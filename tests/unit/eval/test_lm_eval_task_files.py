"""Local task files handed to lm-eval's evaluator (meshformer/eval/task_files.py `lm_eval_config`, run.py): read as
data, with the guarantees of the task-file sandbox: data_files confined to the task's folder, !function only when
trusted, templates checked by the sandbox's rules, and lm-eval's own renderer swapped for the sandbox."""

from __future__ import annotations

import json

import pytest

from meshformer.config.sections import DownstreamConfig
from meshformer.errors import MeshformerError
from meshformer.eval.run import check_include_paths, template_environment
from meshformer.eval.task_files import BUNDLED_DIR, lm_eval_config


def _task(folder, *lines: str, data_files: str = "docs.jsonl") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text(json.dumps({"q": "And God said", "a": "light"}) + "\n")
    yaml = ["task: mine", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data_files}",
            "test_split: test", "output_type: loglikelihood", "doc_to_text: q", "doc_to_target: a", *lines]
    (folder / "mine.yaml").write_text("\n".join(yaml) + "\n")
    return str(folder / "mine.yaml")


def _refused(spec: str, *words: str, options: DownstreamConfig | None = None) -> None:
    with pytest.raises(MeshformerError) as info:
        lm_eval_config(spec, options)
    line = info.value.one_line()
    assert "\n" not in line and all(word in line for word in words), line


@pytest.mark.parametrize("name", ["kjv_cloze", "kjv_next", "kjv_lastword", "kjv_perplexity", "kjv_complete"])
def test_bundled_tasks_become_configs_with_their_files_resolved(name):
    config = lm_eval_config(f"bundled:{name}")
    assert config["task"] == name
    files = config["dataset_kwargs"]["data_files"]["test"]
    assert files == [str((BUNDLED_DIR / f"{name}.jsonl").resolve())]


def test_data_files_stay_inside_the_task_folder(tmp_path):
    (tmp_path / "secret.jsonl").write_text("{}\n")
    _refused(_task(tmp_path / "t", data_files="../secret.jsonl"), "leaves its folder")
    _refused(_task(tmp_path / "u", data_files=str(tmp_path / "secret.jsonl")), "not a file inside its folder")
    _refused(_task(tmp_path / "v", data_files="missing.jsonl"), "not found")


def test_function_needs_trust(tmp_path):
    folder = tmp_path / "t"
    spec = _task(folder, "process_docs: !function utils.keep")
    (folder / "utils.py").write_text("def keep(dataset):\n    return dataset\n")
    _refused(spec, "!function utils.keep", "downstream.trust_task_code = true")
    config = lm_eval_config(spec, DownstreamConfig(trust_task_code=True))
    assert callable(config["process_docs"]) and config["process_docs"].__name__ == "keep"


def test_templates_are_checked_before_anything_renders(tmp_path):
    _refused(_task(tmp_path / "t", "description: \"{{ cycler.__init__.__globals__ }}\""), "reaches Python internals")
    _refused(_task(tmp_path / "u", "include: other.yaml"), "include is not supported")
    trusted = lm_eval_config(_task(tmp_path / "w", "description: \"{{ q|upper }}\""),
                             DownstreamConfig(trust_task_code=True))
    assert trusted["description"] == "{{ q|upper }}"


def test_lm_evals_renderer_is_the_sandbox_unless_trusted():
    import lm_eval.utils
    from jinja2.sandbox import SecurityError

    own = lm_eval.utils.env
    with template_environment(trust=False):
        assert lm_eval.utils.apply_template("{{ q.strip() }}!", {"q": " light "}) == "light!"
        with pytest.raises(SecurityError):
            lm_eval.utils.apply_template("{{ q.__class__.__mro__ }}", {"q": "x"})
    assert lm_eval.utils.env is own
    with template_environment(trust=True):
        assert lm_eval.utils.env is own


def test_an_include_path_with_task_code_needs_trust(tmp_path):
    (tmp_path / "t.yaml").write_text("task: t\nprocess_docs: !function utils.f\n")
    with pytest.raises(MeshformerError, match="runs Python code"):
        check_include_paths([str(tmp_path)], trust=False)
    check_include_paths([str(tmp_path)], trust=True)
