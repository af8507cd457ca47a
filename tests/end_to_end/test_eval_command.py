"""`meshformer eval` on an exported tiny model: lm-eval's results JSON, the same under two data-parallel processes
as under one (within fp32 rounding: the ranks' batches hold other requests), and a registry task whose dataset is
not cached named in one line before any scoring."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.hf_models import hf_model

pytestmark = pytest.mark.slow
TASKS = "bundled:kjv_cloze,bundled:kjv_lastword,bundled:kjv_perplexity,bundled:kjv_complete"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.data import load_tokenizer

    out = tmp_path_factory.mktemp("exported")
    model = from_hf_model(hf_model("llama"))
    export_hf(model.state_dict(), model.cfg, out, tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    return out


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "meshformer", "eval", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.matrix  # two eval runs of the tiny model (about 4 minutes of CI)
def test_two_data_parallel_processes_write_one_processs_results(folder, tmp_path):
    outputs = []
    for nproc in (1, 2):
        out = tmp_path / f"results{nproc}.json"
        done = _eval(str(folder), "--tasks", TASKS, "--limit", "4", "--output-path", str(out),
                     "--nproc-per-node", str(nproc))
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(out.read_text()))
    one, two = outputs
    assert set(one["results"]) == {"kjv_cloze", "kjv_lastword", "kjv_perplexity", "kjv_complete"}
    for task, metrics in one["results"].items():  # counts equal; values within fp32 rounding (batches differ)
        assert metrics.keys() == two["results"][task].keys()
        for key, value in metrics.items():
            if "perplexity_stderr" in key:  # lm-eval's bootstrap resamples the gathered order, which the ranks set
                continue
            if isinstance(value, float):
                assert two["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
            else:
                assert two["results"][task][key] == value, (task, key)
    assert one["results"]["kjv_cloze"]["acc,none"] == two["results"]["kjv_cloze"]["acc,none"]
    assert one["results"]["kjv_perplexity"]["word_perplexity,none"] > 1.0


def test_a_task_without_its_dataset_is_one_line(folder):
    done = _eval(str(folder), "--tasks", "hellaswag", "--limit", "2")
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: task hellaswag: its dataset is not in the local datasets cache"), line
    assert "get_task_dict(['hellaswag'])" in line
