"""What the user pages say against what the code does: the downstream-evaluation page's example task loads as
shown, from any folder, and its rules name the keys that relax them; a page that reads a Hugging Face folder
makes it first; the `docs` extra installs the site's tools at the pinned versions."""

from __future__ import annotations

import tomllib

from helpers.common import ROOT
from helpers.readme import shown_commands, shown_files

from meshformer.eval.task_files import rendered_docs

EVALUATION = ROOT / "docs" / "evaluation.md"


def test_the_evaluation_pages_task_loads_as_shown_from_another_folder(tmp_path, monkeypatch):
    files = dict(shown_files(EVALUATION))
    assert set(files) == {"tasks/verses/verses.yaml", "tasks/verses/verses.jsonl"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # data_files are the YAML folder's, not the current folder's
    docs = rendered_docs(str(tmp_path / "tasks" / "verses" / "verses.yaml"))
    assert len(docs) == 5
    assert docs[0]["text"] == "Complete the verse: In the beginning God created the heaven and the"
    assert [d["choices"][d["target"]] for d in docs] == ["earth", "light", "shepherd", "meek", "world"]
    commands = shown_commands([EVALUATION])
    train = next(s for s in commands if s.words[1:2] == ["train"])
    assert "tasks/verses/verses.yaml" in train.line
    lm_eval = next(s for s in commands if s.words[0] == "lm_eval")
    assert lm_eval.cwd == "tasks/verses" and "--include_path" in lm_eval.words  # lm-eval reads from the folder


def test_the_evaluation_page_states_the_rules_a_task_file_is_read_under():
    text = EVALUATION.read_text()
    for said in ("resolved against the task YAML's folder", "resolved against the current folder",
                 "`downstream.follow_links = true`", "jinja2's sandbox", "`downstream.trust_task_code = true`",
                 "`!function`", "lm_eval --model hf"):
        assert said in text, said
    clusters = (ROOT / "docs" / "clusters.md").read_text()
    assert "(evaluation.md)" in clusters and "acc_norm" not in clusters  # the details live on one page


def test_a_page_that_reads_a_hugging_face_folder_makes_it_first():
    made: dict[str, set[str]] = {}
    for s in shown_commands():
        words = s.words
        if words[1:3] == ["convert", "export-hf"]:
            made.setdefault(s.page, set()).add(words[4])
        if "--init-from" in words:
            folder = words[words.index("--init-from") + 1]
            assert folder in made.get(s.page, set()), f"{s.page}: `{s.line}` reads {folder}, made nowhere above"


def test_the_docs_extra_installs_the_site_tools_at_the_pinned_versions():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = [req.split(">")[0].split("=")[0] for req in extras["docs"]]
    assert names == ["mkdocs", "mkdocs-material"] and set(extras["docs"]) <= set(extras["dev"])
    pinned = {line.split("==")[0] for line in (ROOT / "constraints.txt").read_text().splitlines() if "==" in line}
    assert set(names) <= pinned
    assert '-e ".[docs]"' in (ROOT / "docs" / "getting-started.md").read_text()
    assert '".[docs]"' in (ROOT / "README.md").read_text()
