"""Someone else's folders run none of their code: a run folder's saved config never names the callbacks or
downstream tasks of a resume, `generate`, `--init-from` or `convert` (only the user's own config and command do),
and a module in the working folder shadows none of meshformer's imports, on one process or under torchrun."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import tomli_w
from helpers.common import ROOT
from helpers.data import shards

from meshformer.cli import main

CFG = str(ROOT / "configs" / "tiny-gpt.toml")
TINY = ["model.d_model=32", "model.n_layers=1", "model.ffn.d_ff=64", "data.seq_len=32", "model.max_seq_len=64",
        "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false", "data.num_workers=0",
        "checkpoint.interval=1"]
PLANTED = "shared_folder_planted"  # the module a planted [[callbacks]] entry names


def _plant(run: Path, markers: Path) -> None:
    """Put a callback and a trusted task with code into the run's saved configs (config.toml and every checkpoint's
    trainer state), and the code they name where it would import: each writes a marker file when imported."""
    code = f"open({str(markers)!r} + '/' + __name__, 'w').close()\n"
    (markers / "code").mkdir(parents=True)
    (markers / "code" / f"{PLANTED}.py").write_text(
        code + "from meshformer.train.callbacks import Callback\nclass Planted(Callback):\n    pass\n")
    (run / "task_code.py").write_text(code + "def text(doc):\n    return doc['q']\n")
    (run / "docs.jsonl").write_text('{"q": "a", "o": ["x", "y"], "i": 0}\n')
    (run / "task.yaml").write_text(textwrap.dedent("""\
        task: planted
        dataset_path: json
        dataset_kwargs: {data_files: {test: docs.jsonl}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: !function task_code.text
        doc_to_choice: o
        doc_to_target: i
        """))
    planted = {"callbacks": [{"path": f"{PLANTED}:Planted", "args": {}}],
               "downstream": {"tasks": [str(run / "task.yaml")], "trust_task_code": True}}
    for path in [run / "config.toml", *run.glob("checkpoints/*/config.toml")]:
        tree = tomllib.loads(path.read_text())
        path.write_text(tomli_w.dumps(_merged(tree, planted)))
    states = list(run.glob("checkpoints/*/trainer_state.json"))
    assert states
    for state in states:
        saved = json.loads(state.read_text())
        saved["config"] = _merged(saved["config"], planted)
        state.write_text(json.dumps(saved))
        _sign(state.parent)  # whoever shares the folder can rewrite its manifest too


def _merged(tree: dict, planted: dict) -> dict:
    return {**tree, **planted, "downstream": {**tree.get("downstream", {}), **planted["downstream"]}}


def _sign(step: Path) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    for name, entry in manifest["files"].items():
        data = (step / name).read_bytes()
        entry.update(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    (step / "manifest.json").write_text(json.dumps(manifest, indent=1))


@pytest.mark.slow
def test_a_run_folders_saved_config_imports_nothing(tmp_path, monkeypatch, capsys, one_thread):
    """Resume, generate, convert and --init-from on a run folder whose saved config names a callback and a task
    with code (importable, so a wrongful import would show): the user's command names neither; none is imported."""
    data = shards(tmp_path)
    run, markers = tmp_path / "theirs", tmp_path / "markers"
    main(["train", CFG, "--set", *TINY, "train.steps=2", f"logging.run_dir={run}", f"data.shards={data}"])
    _plant(run, markers)
    monkeypatch.syspath_prepend(str(markers / "code"))
    monkeypatch.chdir(tmp_path)
    main(["train", CFG, "--set", *TINY, "train.steps=3", f"logging.run_dir={run}", f"data.shards={data}"])
    assert "reached step 3" in capsys.readouterr().err or (run / "final").is_dir()
    for argv in (["generate", str(run / "final"), "--prompt", "And God", "--max-new-tokens", "2"],
                 ["convert", "to-safetensors", str(run / "checkpoints"), str(tmp_path / "weights")],
                 ["convert", "export-hf", str(run / "final"), str(tmp_path / "hf"), "--arch", "gpt2"],
                 ["train", "--init-from", str(tmp_path / "hf"), "--set", "train.steps=1", "data.seq_len=32",
                  "train.eval_interval=0", "train.sample_interval=0", "logging.tensorboard=false",
                  "data.num_workers=0", f"logging.run_dir={tmp_path / 'mine'}", f"data.cache_dir={tmp_path / 'c'}",
                  f"data.corpus={tmp_path / 'small-corpus' / 'small.jsonl'}"]):  # prepared with the folder's tokenizer
        try:
            main(argv)
        except SystemExit as stop:
            assert stop.code in (0, None), (argv, stop.code)
    assert not [p.name for p in markers.iterdir() if p.is_file()], "code named by their saved config was imported"
    assert PLANTED not in sys.modules


@pytest.mark.slow
def test_a_module_in_the_working_folder_shadows_nothing(tmp_path):
    """`torch.py`, `meshformer.py`, ... in the folder a user trains from: `python -m` would put that folder first on
    the ranks' sys.path; each file here writes a marker and exits if imported. One rank and two (torchrun)."""
    data = shards(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("torch", "meshformer", "numpy", "yaml", "safetensors", "webdataset"):
        (work / f"{name}.py").write_text(f"open({str(tmp_path / name)!r} + '.imported', 'w').close()\n"
                                         "raise SystemExit('shadowed')\n")
    script = tmp_path / "bin" / "meshformer"  # the console script as pip writes it
    script.parent.mkdir()
    script.write_text("import sys\nfrom meshformer.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for launch in ([], ["--nproc-per-node", "2"]):
        out = subprocess.run([sys.executable, str(script), "train", CFG, *launch, "--set", *TINY, "train.steps=1",
                              f"logging.run_dir={tmp_path / ('run' + ''.join(launch[1:]))}", f"data.shards={data}"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (launch, (out.stdout + out.stderr)[-3000:])
        assert not list(tmp_path.glob("*.imported")), launch
