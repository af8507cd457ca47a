"""`meshformer eval` on an exported tiny model: lm-eval's results JSON, the same under two data-parallel processes
as under one (within fp32 rounding: the ranks' batches hold other requests), and a registry task whose dataset is
not cached named in one line before any scoring.

Under a layout (`--nproc-per-node 2 --set parallel.*`: pipeline, tensor, context, FSDP, expert parallel on a tiny
MoE) the folder's model is held as that layout holds it and every request gets one process's log-likelihood, rolling
log-likelihood, greedy generation and seeded sampled generation; the pipeline row reads a run folder's checkpoint,
with no export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.hf_models import hf_model
from helpers.sampled_task import sampled_task

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


# ------------------------------------------------------------------------------------------------ layouts

LIMIT = 4



def _one_process(folder: Path, tasks: list[str]) -> dict[str, Any]:
    """What `meshformer eval FOLDER` computes in one process (its MeshformerLM and evaluator), with the samples."""
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate

    results = evaluate(MeshformerLM(path=str(folder), batch_size=16), tasks, limit=LIMIT, log_samples=True)
    assert results is not None
    return results


def _assert_same(one: dict[str, Any], other: dict[str, Any], skip_bootstrap: bool = False) -> None:
    """Every request's response (log-likelihoods within 1e-4, rolling ones within 1e-4 relative, generated texts
    equal) and every metric (rel 1e-5)."""
    assert set(other["results"]) <= set(one["results"])
    for task, samples in one["samples"].items():
        if task not in other["results"]:
            continue
        mine = sorted(other["samples"][task], key=lambda s: s["doc_id"])
        for a, b in zip(sorted(samples, key=lambda s: s["doc_id"]), mine, strict=True):
            for x, y in zip(a["resps"], b["resps"], strict=True):
                if isinstance(x[0], str):
                    assert y[0] == x[0], (task, a["doc_id"])
                elif isinstance(x[0], float):  # a rolling log-likelihood: a sum over the document's tokens
                    assert y[0] == pytest.approx(x[0], abs=1e-4 * max(1.0, abs(x[0]))), (task, a["doc_id"])
                else:
                    assert y[0][0] == pytest.approx(x[0][0], abs=1e-4) and y[0][1] == x[0][1], (task, a["doc_id"])
        for key, value in one["results"][task].items():
            if skip_bootstrap and "perplexity_stderr" in key:  # resamples the gathered order, which the ranks set
                continue
            if isinstance(value, float):
                assert other["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)


@pytest.fixture(scope="module")
def layout_case(folder, tmp_path_factory):
    """The exported model's one-process results, and the same weights as a run folder holding a checkpoint."""
    from meshformer.checkpointing.safetensors_io import write_weights_checkpoint
    from meshformer.data import load_tokenizer
    from meshformer.eval.model_folder import load_model_folder

    root = tmp_path_factory.mktemp("layouts")
    tasks = ["bundled:kjv_lastword", "bundled:kjv_complete", sampled_task(root), "bundled:kjv_perplexity"]
    model, _ = load_model_folder(folder)
    write_weights_checkpoint(model.state_dict(), model.cfg, root / "run" / "checkpoints",
                             load_tokenizer("bundled:kjv-bpe-4k"))
    return {"tasks": tasks, "one": _one_process(folder, tasks), "run": root / "run"}


def _two_ranks(folder: Path, tasks: list[str], out: Path, *sets: str) -> dict[str, Any]:
    args = [a for item in sets for a in ("--set", item)]
    done = _eval(str(folder), "--tasks", ",".join(tasks), "--limit", str(LIMIT), "--log-samples", "--output-path",
                 str(out), "--nproc-per-node", "2", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.matrix  # a two-rank eval run and a one-process reference (minutes): CI's row for layout generation is
# tests/end_to_end/test_downstream.py's tp2 row, which decodes through the same step (LayoutNextLogits)
def test_a_pipeline_generates_and_scores_as_one_process_from_a_run_folder(layout_case, tmp_path):
    """pp2 on a run folder without final/ (its checkpoint, no export): greedy and sampled generation run through
    the stages, and rolling log-likelihoods (not the loglikelihood task: the matrix rows and the in-loop rows score
    it under layouts)."""
    two = _two_ranks(layout_case["run"], layout_case["tasks"][1:], tmp_path / "pp2.json", "parallel.pp=2")
    _assert_same(layout_case["one"], two)
    assert set(two["samples"]) == {"kjv_complete", "kjv_sampled", "kjv_perplexity"}


@pytest.mark.matrix  # a two-rank eval run each (minutes)
@pytest.mark.parametrize("sets", [(), ("parallel.tp=2",), ("parallel.cp=2",), ("parallel.dp_shard=2",)],
                         ids=["dp2", "tp2", "cp2", "fsdp2"])
def test_two_rank_layouts_score_and_sample_as_one_process(folder, layout_case, tmp_path, sets):
    """dp2 (lm-eval's data parallel, a whole model per rank) and the --set layouts on the Hugging Face folder:
    the same log-likelihoods, greedy texts and sampled texts (seeded per request) as one process."""
    two = _two_ranks(folder, layout_case["tasks"], tmp_path / "two.json", *sets)
    _assert_same(layout_case["one"], two, skip_bootstrap=not sets)


@pytest.mark.matrix
def test_expert_parallel_scores_and_generates_as_one_process(tmp_path):
    """ep2 on a tiny mixture of experts (tiny-moe's blocks, narrower): each rank holds half of the experts."""
    import torch

    from meshformer.checkpointing.weights import write_weights
    from meshformer.config import load_config
    from meshformer.data import load_tokenizer
    from meshformer.model import Transformer

    cfg = load_config("tiny-moe", ["model.d_model=32", "model.n_layers=2", "model.max_seq_len=64",
                                   "model.moe.d_ff=32", "model.attention.n_heads=2", "data.seq_len=64"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    with torch.no_grad():  # sharper than the init, so greedy choices are far from ties
        for param in model.parameters():
            if param.ndim > 1:
                param.normal_(0.0, 0.15)
    write_weights(model.state_dict(), cfg.model, tmp_path / "moe", tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    tasks = ["bundled:kjv_lastword", "bundled:kjv_complete", sampled_task(tmp_path), "bundled:kjv_perplexity"]
    one = _one_process(tmp_path / "moe", tasks)
    _assert_same(one, _two_ranks(tmp_path / "moe", tasks, tmp_path / "ep2.json", "parallel.ep=2"))
