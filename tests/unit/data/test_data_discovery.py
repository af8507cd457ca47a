"""`data prepare DIR`: nothing in a folder is dropped in silence (#24). Text files not named as a corpus are an
error naming them unless `--include` says to read them; binary files are skipped and logged with the reason;
compressed and columnar files are recognised by their first bytes, whatever their names."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.data import kjv_docs

from meshformer.cli import main
from meshformer.data import prepare
from meshformer.data.sources import CorpusError, resolve_inputs

KW = dict(tokenizer="bundled:kjv-bpe-4k", record_len=33, eval_fraction=0.0, progress=False)
DOCS = kjv_docs(4)


def user_folder(root: Path) -> Path:
    """A folder as users have them: a named text file, a gzip text file and an extension-less text file."""
    folder = root / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "NEWS.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    (folder / "README").write_text(DOCS[2])
    return folder


def test_unnamed_text_files_are_an_error_naming_them(tmp_path):
    with pytest.raises(CorpusError) as err:
        prepare(user_folder(tmp_path), tmp_path / "out", **KW)
    line = str(err.value)
    assert "NEWS.gz" in line and "README" in line and "--include" in line and "a.txt" not in line
    assert not (tmp_path / "out").exists()


def test_include_reads_the_files_it_matches(tmp_path):
    folder = user_folder(tmp_path)
    every = prepare(folder, tmp_path / "every", include=["*"], **KW)
    assert every is not None and every.meta["documents"]["train"] == 3
    assert sorted(Path(p).name for p in every.meta["inputs"]) == ["NEWS.gz", "README", "a.txt"]
    some = resolve_inputs(folder, include=["*.gz", "a.*"])
    assert [p.name for p in some] == ["NEWS.gz", "a.txt"]


def test_a_folder_reports_what_it_read_and_skipped(tmp_path, caplog):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "sub" / "b.jsonl").write_text('{"text": "one"}\n')
    (folder / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (folder / "empty").write_bytes(b"")
    (folder / ".hidden.txt").write_text("not read")
    files = resolve_inputs(folder)
    assert [p.relative_to(folder).as_posix() for p in files] == ["a.txt", "sub/b.jsonl"]
    with caplog.at_level(logging.INFO, logger="meshformer.data"):
        prepare(folder, tmp_path / "out", **KW)
    report = next(r.getMessage() for r in caplog.records if "reading 2 file(s)" in r.getMessage())
    assert "1 text" in report and "1 jsonl" in report and "skipped 3" in report
    assert "not text (logo.png)" in report and "empty (empty)" in report and "hidden (.hidden.txt)" in report


def test_files_are_recognised_by_content_not_only_by_name(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    pq.write_table(pa.table({"text": DOCS[:2]}), folder / "part-00000")  # Spark-style name, no extension
    (folder / "c.txt").write_bytes(gzip.compress(DOCS[2].encode()))  # gzip under a text name
    manifest = prepare(folder, tmp_path / "out", **KW)
    assert manifest is not None and manifest.meta["documents"]["train"] == 3


def test_cli_error_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "prepare", str(user_folder(tmp_path)), "--out", str(tmp_path / "out"), "--quiet"])
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and message.count("\n") == 0 and "NEWS.gz" in message


def test_links_out_of_a_corpus_folder_are_read_only_when_asked(tmp_path, capsys):
    from meshformer.folders import UnsafePathError

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "more").mkdir(parents=True)
    (elsewhere / "notes.txt").write_text("outside text\n")
    (elsewhere / "more" / "b.txt").write_text("more outside text\n")
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("inside text\n")
    (folder / "same.txt").symlink_to("a.txt")  # stays inside: read
    (folder / "more").symlink_to(elsewhere / "more")  # a linked folder leaving it: refused too, not skipped
    with pytest.raises(UnsafePathError, match=r"corpus/more links to .*elsewhere/more, outside"):
        resolve_inputs(folder)
    (folder / "more").unlink()
    (folder / "notes.txt").symlink_to(elsewhere / "notes.txt")
    with pytest.raises(UnsafePathError, match=r"corpus/notes.txt links to .*elsewhere/notes.txt, outside"):
        resolve_inputs(folder)
    (folder / "more").symlink_to(elsewhere / "more")
    assert [p.name for p in resolve_inputs(folder, follow_links=True)] == ["a.txt", "b.txt", "notes.txt", "same.txt"]
    main(["data", "submit-prepare", str(folder), "--out", str(tmp_path / "o"), "--parts", "2", "--dry-run",
          "--tokenizer", "bundled:kjv-bpe-4k", "--follow-links"])
    scripts = capsys.readouterr().out.split("#!/bin/bash")[1:]
    assert len(scripts) == 3 and all("--follow-links" in s for s in scripts)
