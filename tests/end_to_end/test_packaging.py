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
from helpers.readme import doc_commands

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
    tasks = {f"meshformer/eval/tasks/kjv_{t}.{ext}" for t in ("cloze", "next") for ext in ("yaml", "jsonl")}
    assert tasks <= names, tasks - names


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(the venv's bin folder, the environment to run it in, an empty folder) with the wheel installed."""
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    empty = root / "empty"
    empty.mkdir()
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
                   cwd=empty, env=clean, check=True)
    # torch and the other dependencies come from this interpreter's site-packages, put on the path without
    # running its .pth files, so the repository's editable install (a .pth import hook) cannot shadow the wheel.
    deps = os.pathsep.join(dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]))
    env = {**os.environ, "MESHFORMER_CACHE": str(root / "cache"), "PYTHONPATH": deps, "OMP_NUM_THREADS": "2"}
    where = subprocess.run([python, "-c", "import meshformer; print(meshformer.__file__)"], cwd=empty, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where
    return venv / "bin", env, empty


# A quick-start run cut to a few steps: the documented `meshformer train tiny-gpt` with these overrides.
SHORT_RUN = ["train.steps=3", "logging.log_interval=1", "train.eval_interval=3", "train.eval_batches=1",
             "train.sample_interval=0", "checkpoint.interval=0", "data.num_workers=0"]


def test_wheel_install_trains_a_bundled_config_from_an_empty_folder(installed):
    bin_dir, env, empty = installed
    run = subprocess.run([bin_dir / "meshformer", "train", "tiny-gpt", "--set", *SHORT_RUN],
                         cwd=empty, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step      3/3" in run.stderr + run.stdout
    assert (empty / "runs" / "tiny-gpt" / "final").is_dir()


@pytest.mark.slow
def test_documented_commands_run_from_an_installed_wheel_in_an_empty_folder(installed, tmp_path):
    """The quick start, "Looking at a run" and the bundled-config commands, verbatim from the README and the docs (a
    training run cut to a few steps), in a folder with nothing but what they write."""
    bin_dir, env, _ = installed
    folder = tmp_path / "user"
    folder.mkdir()
    commands = doc_commands()
    quick_start = next(words for words in commands if words[1:3] == ["train", "tiny-gpt"] and len(words) == 3)
    after = [words for words in commands if words[1] in ("generate", "attention-map", "grad-report", "params",
                                                         "config")]
    assert {words[1] for words in after} == {"generate", "attention-map", "grad-report", "params", "config"}
    for words in [[*quick_start, "--set", *SHORT_RUN], *after, ["meshformer", "train", "tiny-gpt.toml", "--set",
                                                                 *SHORT_RUN, "--new-run"]]:
        out = subprocess.run([bin_dir / words[0], *words[1:]], cwd=folder, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, (words, out.stderr[-3000:])
    assert (folder / "runs" / "tiny-gpt" / "final").is_dir() and (folder / "attn.png").is_file()
    assert (folder / "runs" / "tiny-gpt-2" / "final").is_dir()  # the copied config, trained beside the first run


@pytest.mark.slow
def test_the_first_hour_runs_from_an_installed_wheel_in_an_empty_folder(installed, tmp_path):
    """bench/first_hour.py's journey (train, export to Hugging Face, generate, continue from that folder), each
    command as the docs show it, the training runs cut to a few steps."""
    sys.path.insert(0, str(REPO / "bench"))
    import first_hour

    bin_dir, env, _ = installed
    env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
    folder = tmp_path / "user"
    folder.mkdir()
    shorter = " " + " ".join(s for s in SHORT_RUN if not s.startswith("checkpoint."))
    for _, command in first_hour.JOURNEY:
        line = command + shorter if command.split()[1] == "train" else command
        out = subprocess.run(line, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, (line, out.stderr[-3000:])
    assert (folder / "hf" / "tiny-gpt" / "config.json").is_file()
    assert (folder / "runs" / "tiny-gpt-2" / "final").is_dir()
