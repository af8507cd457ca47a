"""In-loop downstream scores (lm-eval's evaluator over the training layout) equal lm-evaluation-harness' own `hf`
model's on the exported checkpoint, and two-rank layouts' scores equal one process's.

A tiny model trains a few steps with both bundled multiple-choice tasks in `downstream.tasks`; its final weights are
exported to a Hugging Face folder, which lm-eval 0.4.13 scores (HFLM on CPU, the same task YAML and JSONL as a local
task). The summed log-likelihood of every (document, choice) request, acc / acc_norm and their standard errors must
agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.checkpoints import launch, tiny_config, tiny_overrides, tiny_shards
from helpers.sampled_task import sampled_task

from meshformer.eval.task_files import BUNDLED_DIR
from meshformer.train.trainer import Trainer

pytestmark = pytest.mark.slow
TASKS = ("kjv_cloze", "kjv_next")
DOWNSTREAM = ('downstream.tasks=["bundled:kjv_cloze", "bundled:kjv_next"]', "downstream.batch_size=16")
STEPS = 8
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "downstream_worker.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny model trained with the bundled tasks scored in the loop, exported to an HF folder."""
    from meshformer.cli import main

    root = tmp_path_factory.mktemp("downstream")
    shards = tiny_shards(root)
    cfg = tiny_config(shards, root / "run", STEPS, *DOWNSTREAM, "downstream.interval=5", f"checkpoint.interval={STEPS}")
    trainer = Trainer(cfg)
    trainer.fit()
    assert trainer.downstream is not None
    main(["convert", "export-hf", str(root / "run" / "final"), str(root / "hf")])
    return {"root": root, "shards": shards, "scores": trainer.downstream.last, "hf": root / "hf", "trainer": trainer}


def test_in_loop_scores_are_logged_as_metrics(trained):
    lines = [json.loads(line) for line in (trained["root"] / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if "downstream/kjv_cloze/acc" in line]
    assert [line["step"] for line in logged] == [5, STEPS]  # downstream.interval, and the last step
    logged = logged[-1]
    for task in TASKS:
        assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr"} <= trained["scores"][task].keys()
        for key, value in trained["scores"][task].items():
            assert logged[f"downstream/{task}/{key}"] == pytest.approx(value, abs=1e-12)


def test_scores_equal_lm_evals_on_the_exported_model(trained, tmp_path):
    """The in-loop metrics after the last step, and every request's log-likelihood as the in-loop scorer (the
    layout's evaluation forward) gives it, equal lm-eval's `hf` model's on the exported final weights."""
    import lm_eval  # the dev extra pins lm-eval[hf]==0.4.13
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate
    from meshformer.train.downstream import LayoutScorer

    # lm-eval reads data_files relative to the current directory: the same tasks with absolute paths
    for task in TASKS:
        shutil.copy(BUNDLED_DIR / f"{task}.jsonl", tmp_path / f"{task}.jsonl")
        text = (BUNDLED_DIR / f"{task}.yaml").read_text().replace(f"{task}.jsonl", str(tmp_path / f"{task}.jsonl"))
        (tmp_path / f"{task}.yaml").write_text(text)
    model = HFLM(pretrained=str(trained["hf"]), device="cpu", batch_size=16, dtype="float32")
    assert model.max_length == 32  # data.seq_len of the run: both cut long requests the same way
    out = lm_eval.simple_evaluate(model=model, tasks=list(TASKS), num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
    trainer = trained["trainer"]
    scorer = LayoutScorer(trainer.parallel_model, trainer.cfg, 16, trainer.tokenizer.pad_id, lambda: None)
    ours = evaluate(MeshformerLM(model=trainer.model, tokenizer=trainer.tokenizer, scorer=scorer, batch_size=16,
                                 max_length=32), [f"bundled:{t}" for t in TASKS], log_samples=True)
    assert ours is not None
    for task in TASKS:
        logliks = [[[float(r[0][0]) for r in s["resps"]] for s in sorted(run["samples"][task],
                                                                          key=lambda s: s["doc_id"])]
                   for run in (ours, out)]
        assert len(logliks[0]) == len(logliks[1]) == 40
        worst = max(abs(a - b) for mine, other in zip(*logliks) for a, b in zip(mine, other))
        assert worst < 1e-4, (task, worst)
        results = out["results"][task]
        for metric in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
            assert trained["scores"][task][metric] == pytest.approx(results[f"{metric},none"], abs=1e-12), metric
        print(f"{task}: acc {results['acc,none']:.3f} acc_norm {results['acc_norm,none']:.3f}; largest loglik "
              f"difference {worst:.2e}")


def _two_rank_scores(trained, tmp_path, *options: str) -> dict:
    """The trained run's last checkpoint scored by two ranks under `options`: rank 0's SCORES line (and its TEXTS
    line as "texts" with the worker's --texts option)."""
    overrides = tiny_overrides(trained["shards"], tmp_path / "run", STEPS, *options,
                               f'checkpoint.dir="{trained["root"] / "run" / "checkpoints"}"',
                               "checkpoint.resume_other_run=true")
    results = launch(WORKER, 2, overrides, timeout=300.0)
    assert all(r.returncode == 0 for r in results), "\n".join(r.stdout[-3000:] for r in results)
    lines = results[0].stdout.splitlines()
    scores = json.loads(next(x for x in lines if x.startswith("SCORES ")).removeprefix("SCORES "))
    texts = [json.loads(x.removeprefix("TEXTS ")) for x in lines if x.startswith("TEXTS ")]
    return {**scores, "texts": texts[0]} if texts else scores


LM_EVAL_TASKS = ("bundled:kjv_cloze", "bundled:kjv_lastword", "bundled:kjv_perplexity", "bundled:kjv_complete")


def test_in_loop_scores_equal_lm_eval_over_the_whole_model(trained):
    """lm-eval's evaluator over the layout's evaluation forward (multiple choice, loglikelihood with its greedy
    flag, rolling perplexity, generation) gives the metrics and standard errors that lm-eval's evaluator gives over
    MeshformerLM(model=...)."""
    import dataclasses

    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate
    from meshformer.train.downstream import DownstreamEval

    trainer = trained["trainer"]
    cfg = trainer.cfg
    cfg = dataclasses.replace(cfg, downstream=dataclasses.replace(cfg.downstream, tasks=list(LM_EVAL_TASKS), limit=20))
    in_loop = DownstreamEval(cfg, trainer.tokenizer)
    for part in trainer.parallel_model.model_parts:
        part.train()
    scalars = in_loop.run(trainer.parallel_model, whole=trainer.model)
    assert all(part.training for part in trainer.parallel_model.model_parts)  # training mode again after scoring
    whole = MeshformerLM(model=trainer.model, tokenizer=trainer.tokenizer, batch_size=16, max_length=32)
    reference = evaluate(whole, list(LM_EVAL_TASKS), limit=20, options=cfg.downstream)
    assert reference is not None
    compared = 0
    for task, metrics in reference["results"].items():
        for key, value in metrics.items():
            metric, comma, filter_name = key.partition(",")
            if not comma or not isinstance(value, int | float):
                continue
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            assert scalars[f"downstream/{task}/{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, name)
            compared += 1
    assert compared >= 10 and "downstream/kjv_lastword/acc_stderr" in scalars
    assert "downstream/kjv_complete/exact_match_clause" in scalars


LAYOUT_TASKS = LM_EVAL_TASKS  # generation too: the worker's layouts decode step by step through their forward


@pytest.mark.parametrize("layout", [
    pytest.param(("parallel.tp=2", "parallel.dp_shard=1"), id="tp2"),
    pytest.param(("parallel.dp_shard=2",), id="dp2", marks=pytest.mark.matrix),
    pytest.param(("parallel.pp=2", "parallel.dp_shard=1"), id="pp2", marks=pytest.mark.matrix),
    pytest.param(("parallel.cp=2", "parallel.dp_shard=1"), id="cp2", marks=pytest.mark.matrix)])
def test_two_rank_lm_eval_scores_equal_one_process(trained, tmp_path, layout):
    """Under a two-rank layout (the run's last checkpoint resharded to it; data parallel: each rank scores half the
    requests; pipeline: the last stage scores them) lm-eval's metrics and standard errors (multiple choice,
    loglikelihood with greedy flags, rolling perplexity, generation) equal one process's."""
    import dataclasses

    from meshformer.train.downstream import DownstreamEval

    trainer = trained["trainer"]
    options = ["downstream.limit=20", "downstream.batch_size=16",
               "downstream.tasks=[" + ", ".join(f'"{t}"' for t in LAYOUT_TASKS) + "]"]
    cfg = dataclasses.replace(trainer.cfg, downstream=dataclasses.replace(
        trainer.cfg.downstream, tasks=list(LAYOUT_TASKS), limit=20))
    one = DownstreamEval(cfg, trainer.tokenizer)
    one.run(trainer.parallel_model, whole=trainer.model)
    scores = _two_rank_scores(trained, tmp_path, *options, *layout)
    assert set(scores) == set(one.last) == {t.removeprefix("bundled:") for t in LAYOUT_TASKS}
    for task, metrics in one.last.items():
        assert scores[task]["metrics"].keys() == metrics.keys()
        for name, value in metrics.items():
            assert scores[task]["metrics"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, name)


@pytest.mark.matrix
def test_loglikelihood_metrics_and_errors_are_logged_at_the_interval_and_last_step(trained, tmp_path):
    cfg = tiny_config(trained["shards"], tmp_path / "run", 4, "downstream.limit=5",
                      'downstream.tasks=["bundled:kjv_lastword"]', "downstream.interval=3", "checkpoint.interval=4")
    Trainer(cfg).fit()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [line for line in lines if "downstream/kjv_lastword/acc" in line]
    assert [line["step"] for line in logged] == [3, 4]
    assert {"downstream/kjv_lastword/acc_stderr", "downstream/kjv_lastword/perplexity"} <= logged[-1].keys()




@pytest.mark.parametrize("layout", [
    pytest.param(("parallel.tp=2", "parallel.dp_shard=1"), id="tp2"),
    pytest.param(("parallel.pp=2", "parallel.dp_shard=1"), id="pp2", marks=pytest.mark.matrix)])
def test_in_loop_sampled_and_greedy_texts_equal_one_process(trained, tmp_path, layout):
    """In-loop generation under a layout that splits the model (each step's logits from the layout's forward, every
    rank drawing from the request's own seeded generator): each document's sampled and greedy text equals one
    process's (the whole model, through its cache)."""
    from meshformer.eval.lm import MeshformerLM
    from meshformer.eval.run import evaluate

    trainer = trained["trainer"]
    tasks = ["bundled:kjv_complete", sampled_task(tmp_path)]
    whole = MeshformerLM(model=trainer.model, tokenizer=trainer.tokenizer, batch_size=16,
                         max_length=trainer.cfg.data.seq_len)
    reference = evaluate(whole, tasks, limit=8, options=trainer.cfg.downstream, log_samples=True)
    assert reference is not None
    one = {task: [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
           for task, samples in reference["samples"].items()}
    assert len(set(one["kjv_sampled"])) > 1 and one["kjv_sampled"] != one["kjv_complete"]  # sampling is on
    options = ["downstream.limit=8", "downstream.batch_size=16",
               "downstream.tasks=[" + ", ".join(f'"{t}"' for t in tasks) + "]", "--texts"]
    two = _two_rank_scores(trained, tmp_path, *options, *layout)
    assert two["texts"] == one
