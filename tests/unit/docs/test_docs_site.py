"""The documentation site: it builds with warnings as errors, its benchmark pages are what their data renders to,
and the README and user pages say what the project is, briefly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers.common import ROOT, load_script
from helpers.readme import doc_pages, shown_commands


def _render_tables():
    return load_script("bench/render_tables.py")


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs", reason="the dev extra installs mkdocs")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "troubleshooting" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    pages = doc_pages()[1:]
    assert all(page.is_file() for page in pages), [str(p) for p in pages if not p.is_file()]
    on_disk = {p for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), sorted(str(p) for p in on_disk ^ set(pages))


def test_the_benchmark_pages_are_what_their_data_renders_to():
    render = _render_tables()
    pages = render.render_pages(render.load_tables())
    assert set(pages) == {f"{page}.md" for page in render.PAGES}
    for name, text in pages.items():
        assert (ROOT / "docs" / "benchmarks" / name).read_text() == text, \
            f"docs/benchmarks/{name} is stale: run python bench/render_tables.py"
    for table in render.load_tables():
        assert table["machine"] and (table.get("date") or "measured" in table["columns"])


def test_the_renderer_refuses_a_table_without_its_date(tmp_path):
    render = _render_tables()
    (tmp_path / "gpu-01-x.json").write_text('{"page": "gpu", "title": "t", "machine": "m", "columns": ["a"], '
                                            '"rows": [["1"]]}')
    with pytest.raises(ValueError, match="give the date it was measured on"):
        render.load_tables(tmp_path)


def test_the_readme_is_short_and_opens_with_the_two_set_up_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    assert lines[2:6] == ["```bash", "pip install torch==2.13.0 -e . && meshformer train tiny-gpt",
                          'pip install torch==2.13.0 -c constraints.txt -e ".[dev,megatron]" && python -m pytest -q',
                          "```"]
    for peer in ("Megatron-LM", "torchtitan", "OLMo-core"):
        assert peer in "\n".join(lines)


# Words of a project's history or of a test machine, which user pages do not carry.
HISTORY = re.compile(r"before the fix|earlier names|no longer|used to be|\bgoal\b|not met|load average|"
                     r"\bload \d|shared 2-core|busy machine|idle machine", re.I)


def test_user_pages_say_what_the_project_is_not_how_it_came_to_be():
    user_pages = [p for p in doc_pages() if "benchmarks" not in p.parts]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in user_pages for m in HISTORY.finditer(p.read_text())]
    assert found == []
    package_readmes = list((ROOT / "meshformer").rglob("README.md"))
    assert package_readmes
    for readme in package_readmes:
        assert not re.search(r"learned the hard way|load average|\bload \d", readme.read_text(), re.I), readme


def test_a_command_left_unrun_says_why_on_its_page():
    marked = [s for s in shown_commands() if s.skip]
    assert all(len(s.skip) > 10 for s in marked), [s.line for s in marked]
