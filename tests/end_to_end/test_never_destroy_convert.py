"""`meshformer convert` never destroys or reads what the user did not ask for (#25), end to end with real
processes and files: an output folder is replaced only when it is ours and --overwrite says so (or the user
passes --overwrite for a folder of their own), never when it is, holds or lies inside the input; a config.json
claiming an absurd depth is refused before anything is built from it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.common import ROOT
from helpers.convert import convert_case_files

from meshformer.checkpointing.safetensors_io import safetensors_to_checkpoint
from meshformer.cli import main
from meshformer.folders import MARKER


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("never_destroy_convert")
    convert_case_files(root)
    safetensors_to_checkpoint(root / "cv-weights", root / "cv-ckpt")
    return root


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "meshformer.cli", "convert", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _refused(argv: list[str | Path], capsys) -> str:
    """The one line a refused in-process command prints."""
    with pytest.raises(SystemExit) as info:
        main(["convert", *map(str, argv)])
    line = str(info.value.code)
    assert line.startswith("error: ") and "\n" not in line and not capsys.readouterr().err, line
    return line


def _commands(w: Path) -> list[list[str | Path]]:
    """Every convert subcommand that writes a folder, as [name, src]."""
    return [["to-safetensors", w / "cv-ckpt"], ["to-checkpoint", w / "cv-weights"], ["export-hf", w / "cv-weights"],
            ["import-hf", w / "cv-hf"], ["import-hf", w / "cv-hf", "--checkpoint"],
            ["export-megatron", w / "cv-weights"], ["import-megatron", w / "cv-mc"],
            ["import-megatron", w / "cv-mc", "--checkpoint"]]


def test_a_folder_of_user_files_survives_every_convert_command(world, capsys, one_thread):
    user = world / "cv-user"
    before = _digest(user)
    out = _cli("export-hf", world / "cv-weights", user)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: {user} exists and holds files meshformer did not write"), out.stderr
    for name, src, *flags in _commands(world):
        line = _refused([name, src, user, *flags], capsys)
        assert "meshformer did not write" in line and "--overwrite" in line, (name, line)
    assert _digest(user) == before and not user.with_name(user.name + ".partial").exists()


def test_the_input_is_never_the_output_even_with_overwrite(world, capsys, one_thread):
    weights = world / "cv-weights"
    inputs = [weights, world / "cv-ckpt", world / "cv-hf", world / "cv-mc"]
    before = [_digest(folder) for folder in inputs]
    out = _cli("export-hf", weights, weights, "--overwrite")
    assert out.returncode == 1 and out.stderr.startswith(f"error: the output folder {weights} overlaps the input"), \
        out.stderr
    for name, src, *flags in _commands(world):
        for target in (src, Path(src) / "sub", Path(src).parent):  # is, lies inside, holds the input
            line = _refused([name, src, target, "--overwrite", *flags], capsys)
            assert "overlaps the input" in line, (name, target, line)
    assert [_digest(folder) for folder in inputs] == before


def test_ours_is_replaced_only_with_overwrite(world, capsys, one_thread):
    for name, src, *flags in _commands(world):
        out = world / f"cv-ours-{name}{''.join(flags)}"
        main(["convert", name, str(src), str(out), *flags])
        assert (out / MARKER).is_file(), name
        capsys.readouterr()  # export-hf's note that these weights carry no tokenizer
        written = _digest(out)
        line = _refused([name, src, out, *flags], capsys)
        assert "already holds" in line and "--overwrite" in line, (name, line)
        assert _digest(out) == written
        (out / "stale.txt").write_text("from an older export")
        main(["convert", name, str(src), str(out), "--overwrite", *flags])
        assert (out / MARKER).is_file() and not (out / "stale.txt").exists(), name
        assert not out.with_name(out.name + ".partial").exists() and not out.with_name(out.name + ".replaced").exists()


def test_someone_elses_folder_is_replaced_with_overwrite(world, one_thread):
    theirs = world / "cv-theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("the user asked for this folder to go")
    main(["convert", "export-hf", str(world / "cv-weights"), str(theirs), "--overwrite"])
    assert sorted(p.name for p in theirs.iterdir()) == [MARKER, "config.json", "model.safetensors"]


@pytest.mark.timeout(120)
def test_an_absurd_depth_in_config_json_is_refused_before_building_it(world):
    """n_layer=10^9 in config.json: before, meshformer built the layers' names and shapes until memory ran out."""
    out = _cli("import-hf", world / "cv-hf-layers", world / "cv-o-layers", timeout=60)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "n_layer=1000000000 layers, but the checkpoint holds only 16 tensors" in out.stderr
    assert not (world / "cv-o-layers").exists()


def test_every_checkpoint_reader_refuses_an_index_naming_files_outside(world):
    """Resume and every conversion read a checkpoint's .metadata through one reader: a step whose index names
    `../` files is refused there, not only in import-megatron."""
    from meshformer.checkpointing.dcp_io import SafeFileSystemReader
    from meshformer.folders import UnsafePathError

    with pytest.raises(UnsafePathError, match=r"\.metadata names '\.\./"):
        SafeFileSystemReader(world / "cv-mc-outside" / "iter_0000000").read_metadata()
