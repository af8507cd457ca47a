"""meshformer's lm-eval model (meshformer/eval/lm.py) against lm-eval's own `hf` model on one exported folder: per
request the same log-likelihoods (fp32, 1e-4), the same greedy flags and generations, and the same metrics, for every
output type: the bundled tasks (multiple choice, loglikelihood, loglikelihood_rolling, generate_until) and local
HellaSwag-, ARC- and MMLU-shaped tasks (MMLU-shaped 5-shot)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from helpers.hf_models import hf_model

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "lm_eval_tasks"
TASKS = ["bundled:kjv_cloze", "bundled:kjv_next", "bundled:kjv_lastword", "bundled:kjv_perplexity",
         "bundled:kjv_complete", str(FIXTURES / "hellaswag_like.yaml"), str(FIXTURES / "arc_like.yaml"),
         str(FIXTURES / "mmlu_like.yaml")]
NAMES = ["kjv_cloze", "kjv_next", "kjv_lastword", "kjv_perplexity", "kjv_complete", "hellaswag_like", "arc_like",
         "mmlu_like"]
LIMIT = 4  # documents per task: every output type, fast


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """lm-eval's results (with samples) of the `hf` model and of meshformer's, on one exported tiny Llama."""
    from lm_eval.models.huggingface import HFLM

    from meshformer.checkpointing.hf import from_hf_model
    from meshformer.checkpointing.hf_folder import export_hf
    from meshformer.data import load_tokenizer
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate

    folder = tmp_path_factory.mktemp("exported")
    model = from_hf_model(hf_model("llama"))
    export_hf(model.state_dict(), model.cfg, folder, tokenizer=load_tokenizer("bundled:kjv-bpe-4k"))
    theirs = HFLM(pretrained=str(folder), device="cpu", dtype="float32", batch_size=8)
    ours = MeshformerLM(path=str(folder), batch_size=8)
    return tuple(evaluate(lm, TASKS, limit=LIMIT, log_samples=True, bootstrap_iters=10)  # type: ignore[return-value]
                 for lm in (theirs, ours))


def _responses(results: dict[str, Any], task: str) -> list[Any]:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
@pytest.mark.parametrize("task", NAMES)
def test_requests_and_metrics_equal_lm_eval_hf(both, task):
    theirs, ours = both
    assert theirs["configs"][task]["output_type"] == ours["configs"][task]["output_type"]
    mine, reference = _responses(ours, task), _responses(theirs, task)
    assert len(mine) == len(reference) == LIMIT  # every fixture holds at least LIMIT documents
    for a, b in zip(mine, reference):
        for x, y in zip(a, b, strict=True):
            x, y = x[0], y[0]  # one response per request
            if isinstance(y, str):  # generate_until: the same greedy text
                assert x == y
            elif isinstance(y, tuple | list):  # loglikelihood: (log-likelihood, is greedy)
                assert abs(x[0] - y[0]) <= 1e-4 and bool(x[1]) == bool(y[1])
            else:  # loglikelihood_rolling
                assert abs(x - y) <= 1e-4 * max(1.0, abs(y))
    assert set(ours["results"][task]) == set(theirs["results"][task])
    for key, value in theirs["results"][task].items():
        if isinstance(value, float) and not math.isnan(value):
            assert ours["results"][task][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        else:
            assert ours["results"][task][key] == value, key


@pytest.mark.slow
def test_tasks_cover_every_output_type_and_few_shot(both):
    _, ours = both
    kinds = {ours["configs"][task]["output_type"] for task in NAMES}
    assert kinds == {"multiple_choice", "loglikelihood", "loglikelihood_rolling", "generate_until"}
    assert ours["n-shot"]["mmlu_like"] == 5
    generated = [r[0][0] for r in _responses(ours, "kjv_complete")]
    assert len(set(generated)) > 1 and all(isinstance(text, str) for text in generated)
