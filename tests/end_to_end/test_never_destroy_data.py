"""`data prepare` and prepared datasets never destroy or run what the user did not ask for (#25), end to end:
real files, the real command line, and the user's folders compared byte for byte afterwards."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.common import ROOT
from helpers.data import kjv_docs, shards, small_corpus

from meshformer.cli import main
from meshformer.data import prepare

CFG = "configs/tiny-gpt.toml"
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.steps=1", "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false",
        "data.num_workers=0"]
KJV = ["--tokenizer", "bundled:kjv-bpe-4k", "--quiet"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "meshformer.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err + (f"{info.value.code}\n" if isinstance(info.value.code, str) else "")
    assert info.value.code not in (0, None) and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


@pytest.fixture
def users_folder(tmp_path) -> Path:
    """A folder of someone's own files, and a corpus beside it."""
    folder = tmp_path / "thesis"
    (folder / "chapters").mkdir(parents=True)
    (folder / "chapters" / "one.tex").write_text("years of work\n")
    (folder / "data.bin").write_bytes(bytes(range(256)))
    small_corpus(tmp_path / "corpus", 6)
    return folder


# ----------------------------------------------------------------------------- --out never deletes what is not ours


def test_prepare_into_a_users_folder_is_refused_and_the_folder_survives(users_folder, tmp_path):
    before = _snapshot(users_folder)
    done = _cli("data", "prepare", str(tmp_path / "corpus"), "--out", str(users_folder), *KJV)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {users_folder} exists and holds files meshformer did not write")
    assert _snapshot(users_folder) == before


@pytest.mark.parametrize("out", ["corpus", "corpus/shards", "."])
def test_prepare_never_writes_into_its_input_even_with_overwrite(tmp_path, capsys, out):
    corpus = tmp_path / "corpus"
    small_corpus(corpus, 6)
    (corpus / "notes.txt").write_text("the corpus author's notes\n" * 20)
    before = _snapshot(corpus)
    err = _one_line_error(capsys, ["data", "prepare", str(corpus), "--out", str(tmp_path / out), "--overwrite", *KJV])
    assert "overlaps the input" in err and "outside the input" in err
    assert _snapshot(corpus) == before


def test_folders_named_like_our_scratch_folders_are_not_deleted(users_folder, tmp_path, capsys):
    out = tmp_path / "shards"
    work, partial = tmp_path / "shards.work", tmp_path / "shards.partial"
    for folder in (work, partial):
        shutil.copytree(users_folder, folder)
    err = _one_line_error(capsys, ["data", "prepare", str(tmp_path / "corpus"), "--out", str(out), *KJV])
    assert f"{work} exists and was not made by meshformer" in err and not out.exists()
    shutil.move(work, tmp_path / "moved-away")  # once <out>.work is free, prepare runs; <out>.partial is not its
    main(["data", "prepare", str(tmp_path / "corpus"), "--out", str(out), *KJV])
    assert (out / "manifest.json").is_file() and not work.exists()
    for folder in (tmp_path / "moved-away", partial):
        assert _snapshot(folder) == _snapshot(users_folder)


def test_parts_share_the_marked_work_folder(tmp_path):
    corpus = small_corpus(tmp_path / "corpus", 6)
    for stage in ("map", "reduce"):
        for i in range(2):
            main(["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--part", f"{i}/2", "--stage", stage,
                  *KJV])
    assert (tmp_path / "o.work" / ".meshformer").is_file()
    main(["data", "prepare", str(corpus), "--out", str(tmp_path / "o"), "--stage", "merge", "--part", "0/2", *KJV])
    assert (tmp_path / "o" / "manifest.json").is_file() and not (tmp_path / "o.work").exists()


# ----------------------------------------------------------------------------- a prepared dataset runs nothing


def _tampered(tmp_path: Path, edit) -> Path:
    """A copy of prepared shards whose manifest.json was edited by `edit(tree, folder)`."""
    folder = shutil.copytree(shards(tmp_path / "prepared"), tmp_path / "downloaded")
    tree = json.loads((folder / "manifest.json").read_text())
    edit(tree, folder)
    (folder / "manifest.json").write_text(json.dumps(tree))
    return folder


def _first_shard(tree: dict) -> dict:
    return tree["splits"]["train"]["shards"][0]


def test_a_manifest_shard_that_is_a_command_is_not_run(tmp_path):
    marker = tmp_path / "pwned"
    folder = _tampered(tmp_path, lambda tree, _: _first_shard(tree).update(name=f"pipe:touch {marker}"))
    done = _cli("train", CFG, "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}", f"data.shards={folder}")
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith(f"error: the manifest {folder / 'manifest.json'} names 'pipe:touch")
    assert not marker.exists()


def _outside_by_dots(tree: dict, folder: Path) -> None:
    name = _first_shard(tree)["name"]
    (folder.parent / "elsewhere").mkdir()
    shutil.move(folder / name, folder.parent / "elsewhere" / name)
    _first_shard(tree)["name"] = f"../elsewhere/{name}"


def _outside_by_path(tree: dict, folder: Path) -> None:
    _first_shard(tree)["name"] = str(folder / _first_shard(tree)["name"])


def _tokenizer_elsewhere(tree: dict, folder: Path) -> None:
    tree["tokenizer"]["file"] = "/etc/passwd"


@pytest.mark.parametrize("edit, named", [(_outside_by_dots, "../elsewhere/train-"),
                                         (_outside_by_path, "/downloaded/train-"),
                                         (_tokenizer_elsewhere, "/etc/passwd")])
def test_a_manifest_names_only_files_in_its_folder(tmp_path, capsys, edit, named):
    folder = _tampered(tmp_path, edit)
    err = _one_line_error(capsys, ["train", CFG, "--set", *TINY, f"logging.run_dir={tmp_path / 'run'}",
                                   f"data.shards={folder}"])
    assert f"the manifest {folder / 'manifest.json'} names" in err and named in err, err
    assert "re-run `meshformer data prepare`" in err


# ----------------------------------------------------------------------------- the whole corpus is read as text


HEAD = "In the beginning God created the heaven and the earth.\n" * 2000  # past the first 64 KiB


@pytest.mark.parametrize("name, tail", [
    pytest.param("latin1.txt", "caf\u00e9 cr\u00e8me\n".encode("latin-1"), id="latin1"),
    pytest.param("binary.txt", bytes(range(256)), id="binary"),
    pytest.param("late.jsonl.gz", b'{"text": "\xff\xfe"}\n', id="gzip-jsonl")])
def test_bad_bytes_anywhere_in_a_file_stop_prepare_with_the_offset(tmp_path, capsys, name, tail):
    head = "".join(json.dumps({"text": line}) + "\n" for line in HEAD.splitlines()) if ".jsonl" in name else HEAD
    data = head.encode() + tail
    path = tmp_path / "corpus" / name
    path.parent.mkdir()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    bad = len(head.encode()) + next(i for i, b in enumerate(tail) if b >= 0x80 or b == 0)
    err = _one_line_error(capsys, ["data", "prepare", str(path.parent), "--out", str(tmp_path / "out"), *KJV])
    assert f"{path} is not UTF-8 text" in err and f"at byte offset {bad})" in err, err
    assert "convert it to UTF-8" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["doc.txt", "doc.jsonl"])
def test_a_byte_order_mark_is_not_text(tmp_path, name):
    docs = kjv_docs(4)
    text = "".join(json.dumps({"text": d}) + "\n" for d in docs) if name.endswith(".jsonl") else "\n\n".join(docs)
    prepared = []
    for variant, prefix in (("plain", ""), ("bom", "\ufeff")):
        (tmp_path / variant).mkdir()
        (tmp_path / variant / name).write_text(prefix + text, encoding="utf-8")
        manifest = prepare(tmp_path / variant / name, tmp_path / f"{variant}-out", tokenizer="bundled:kjv-bpe-4k",
                           record_len=17, eval_fraction=0, progress=False)
        prepared.append([s.sha256 for s in manifest.splits["train"]])
    assert prepared[0] == prepared[1]
