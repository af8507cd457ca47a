"""A wheel built from the repository runs the main job from an empty folder: the bundled config (by name),
corpus and tokenizer all ship inside the package."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "meshformer"
    # A copy of the tree as a clean clone has it: the build writes nothing into the repository.
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".whl", ".pytest_cache", ".ruff_cache",
        ".mypy_cache", ".import_linter_cache"))
    dist = src.parent / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(src)], check=True)
    (built,) = dist.glob("meshformer-*.whl")
    return built


def test_wheel_ships_configs_corpus_and_tokenizer(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"meshformer/configs/{p.name}" for p in (REPO / "configs").glob("*.toml")}
    assert expected and expected <= names, expected - names
    assert any(n.startswith("meshformer/data/corpus/") for n in names)
    assert any(n.startswith("meshformer/data/tokenizers/") for n in names)


def test_wheel_install_trains_a_bundled_config_from_an_empty_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    empty = tmp_path / "empty"
    empty.mkdir()
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   cwd=empty, env=clean, check=True)
    # torch and the other dependencies come from this interpreter's site-packages, put on the path without
    # running its .pth files, so the repository's editable install (a .pth import hook) cannot shadow the wheel.
    deps = os.pathsep.join(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))
    env = {**os.environ, "MESHFORMER_CACHE": str(tmp_path / "cache"), "PYTHONPATH": deps}
    where = subprocess.run([python, "-c", "import meshformer; print(meshformer.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    run = subprocess.run(
        [venv / "bin" / "meshformer", "train", "tiny-gpt", "--set", "train.steps=3", "logging.log_interval=1",
         "train.eval_interval=3", "train.eval_batches=1", "train.sample_interval=0", "checkpoint.interval=0",
         "data.num_workers=0"],
        cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step      3/3" in run.stderr + run.stdout
    assert (empty / "runs" / "tiny-gpt" / "final").is_dir()
