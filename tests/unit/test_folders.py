"""The output-folder rule (only ours is replaced, never the input) and closed-world file names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.common import ROOT

from meshformer.folders import (
    MARKER,
    OutputFolderError,
    UnsafePathError,
    check_links,
    check_output,
    inside,
    is_ours,
    mark,
    remove,
    replace,
    scratch,
)


def test_missing_or_empty_output_is_fine(tmp_path):
    check_output(tmp_path / "new", what="shards", overwrite=False)
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", what="shards", overwrite=False)


def test_someone_elses_folder_needs_overwrite_and_ours_too(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputFolderError, match="meshformer did not write"):
        check_output(theirs, what="shards", overwrite=False)
    check_output(theirs, what="shards", overwrite=True)  # the user said so
    ours = tmp_path / "ours"
    ours.mkdir()
    mark(ours, "shards")
    with pytest.raises(OutputFolderError, match="already holds shards.*--overwrite"):
        check_output(ours, what="shards", overwrite=False)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "manifest.json").write_text("{}")
    with pytest.raises(OutputFolderError, match="already holds"):
        check_output(legacy, what="shards", overwrite=False, legacy=["manifest.json"])


@pytest.mark.parametrize("out", ["corpus", "corpus/sub", "."])
def test_the_input_is_never_an_output(tmp_path, out):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    with pytest.raises(OutputFolderError, match="overlaps the input"):
        check_output(tmp_path / out, what="shards", overwrite=True, inputs=[tmp_path / "corpus"])


def test_scratch_folders_of_others_are_reported_not_deleted(tmp_path):
    theirs = tmp_path / "out.work"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="not made by meshformer"):
        scratch(theirs, "work")
    with pytest.raises(OutputFolderError, match="refusing to delete"):
        remove(theirs)
    assert (theirs / "keep.txt").read_text() == "mine"
    ours = scratch(tmp_path / "x.work", "work")
    (ours / "junk").write_text("1")
    assert not (scratch(ours, "work") / "junk").exists() and (ours / MARKER).is_file()
    remove(ours)
    assert not ours.exists()


def test_replace_swaps_whole_folders(tmp_path):
    out, staged = tmp_path / "out", tmp_path / "out.partial"
    for folder, text in ((out, "old"), (staged, "new")):
        folder.mkdir()
        mark(folder, "t")
        (folder / "f").write_text(text)
    replace(staged, out)
    assert (out / "f").read_text() == "new" and not staged.exists() and not (tmp_path / "out.replaced").exists()


@pytest.mark.parametrize("name", ["../x.tar", "/etc/passwd", "pipe:touch /tmp/x", "https://host/x.tar",
                                  "a/../../x", "", "~/x", "file:x", 3, None])
def test_names_outside_the_folder_are_refused(tmp_path, name):
    with pytest.raises(UnsafePathError, match="manifest.json"):
        inside(tmp_path, name, what="manifest.json", fix="re-prepare")


def test_names_inside_the_folder_and_links_out(tmp_path):
    assert inside(tmp_path, "sub/train-000000.tar", what="m", fix="f") == tmp_path / "sub" / "train-000000.tar"
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(UnsafePathError, match="outside"):
        inside(tmp_path, "link/passwd", what="m", fix="f")


def _hub_snapshot(cache: Path) -> Path:
    """A Hugging Face hub cache as `huggingface_hub` lays it out: snapshot files are links into ../../blobs."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model-00001-of-00001.safetensors"):
        (repo / "blobs" / f"hash-{name}").write_text("x")
        (snapshot / name).symlink_to(f"../../blobs/hash-{name}")
    return snapshot


def test_links_leaving_a_folder_are_refused_except_the_hub_cache_layout(tmp_path):
    (tmp_path / "secret").write_text("not yours")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "plain.txt").write_text("x")
    (folder / "inner.txt").symlink_to("plain.txt")  # a link that stays inside
    check_links(folder, [folder / "plain.txt", folder / "inner.txt"], what="w", fix="f")
    (folder / "leak.txt").symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafePathError, match=r"leak.txt links to .*secret, outside .*folder"):
        check_links(folder, sorted(folder.iterdir()), what="w", fix="f")
    snapshot = _hub_snapshot(tmp_path / "hub")
    check_links(snapshot, sorted(snapshot.iterdir()), what="w", fix="f")
    assert inside(snapshot, "model-00001-of-00001.safetensors", what="m", fix="f").is_file()
    # blobs/ beside a folder is the cache's only where the folder is a snapshot of it
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "b").write_text("x")
    (folder / "b").symlink_to(tmp_path / "blobs" / "b")
    with pytest.raises(UnsafePathError, match="outside"):
        inside(folder, "b", what="m", fix="f")
    assert inside(folder, "b", what="m", fix="f", follow_links=True) == folder / "b"


def test_a_marker_says_what_the_folder_holds_and_an_earlier_releases_marker_still_counts(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir()
    mark(ours, "prepared shards")
    assert json.loads((ours / MARKER).read_text())["contents"] == "prepared shards"
    earlier = ROOT / "tests" / "fixtures" / "run_1ed6c24" / "final"  # its marker says "kind": "final weights"
    assert "kind" in json.loads((earlier / MARKER).read_text())
    assert is_ours(earlier)
    with pytest.raises(OutputFolderError, match="--overwrite"):
        check_output(earlier, what="weights", overwrite=False)
