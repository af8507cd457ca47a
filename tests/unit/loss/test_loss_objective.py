"""The one loss object (meshformer/loss/objective.py): `Trainer(cfg, loss=...)` trains with it, the documented custom
loss runs as shown, evaluation scores with another objective without changing the model's, and the objective lists
the model's auxiliary terms with their weights."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.checkpoints import tiny_config, tiny_shards
from helpers.common import ROOT

import meshformer.config
from meshformer.config import load_config
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.loss.objective import AuxTerm, Loss
from meshformer.model import Transformer
from meshformer.parallel.parallel_model import ParallelModel, objective_for
from meshformer.train.trainer import Trainer

EXTENDING = ROOT / "docs" / "extending" / "index.md"


def _first_loss(cfg, loss=None) -> float:
    result = Trainer(cfg, loss=loss).fit()
    return result.history[0]["train/loss"]


def test_trainer_trains_with_the_given_loss(tmp_path):
    shards = tiny_shards(tmp_path)

    def doubled(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return 2.0 * cross_entropy_sum(logits, labels)

    plain = _first_loss(tiny_config(shards, tmp_path / "plain", 1, "train.loss='plain'"))
    custom = _first_loss(tiny_config(shards, tmp_path / "custom", 1), doubled)
    assert custom == pytest.approx(2.0 * plain, rel=1e-5)


@pytest.mark.slow  # two tiny training runs: ~6 s
def test_the_documented_custom_loss_runs_as_shown(tmp_path, monkeypatch):
    section = EXTENDING.read_text().split("## Losses", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block is not None and "loss=focal_loss" in block.group(1)
    shards = tiny_shards(tmp_path)
    # the page's bundled config, shrunk to the test's data and one step
    monkeypatch.setattr(meshformer.config, "load_config",
                        lambda name: tiny_config(shards, tmp_path / "focal", 1, "train.seed=3"))
    namespace: dict = {}
    exec(compile(block.group(1), str(EXTENDING), "exec"), namespace)
    focal = namespace["result"].history[0]["train/loss"]
    plain = _first_loss(tiny_config(shards, tmp_path / "plain", 1, "train.seed=3"))
    # the same first batch and weights: every token's focal loss is below its cross-entropy
    assert 0.0 < focal < plain


def test_evaluate_with_another_objective_leaves_the_models():
    cfg = load_config("tiny-gpt", ["model.n_layers=1", "model.d_model=32", "model.attention.n_heads=2"])
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    plan = ParallelModel(model, cross_entropy_sum, torch.device("cpu"))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 9))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    trained = plan.loss
    halved = trained.with_token_loss(lambda logits, labels: 0.5 * cross_entropy_sum(logits, labels))
    full, tokens = plan.evaluate(batch)
    half, _ = plan.evaluate(batch, halved)
    assert plan.loss is trained and int(tokens) == 16
    assert float(half) == pytest.approx(0.5 * float(full), rel=1e-6)


def test_the_objective_lists_the_models_auxiliary_terms_with_their_weights():
    cfg = load_config("tiny-deepseek", ["model.mtp.depth=1", "model.mtp.loss_weight=0.25", "model.moe.aux_loss=0.01",
                                        "model.moe.router_z_loss=0.001"])
    with torch.device("meta"):
        model = Transformer(cfg.model)
    loss = objective_for(model, cross_entropy_sum)
    assert loss.terms == (AuxTerm("mtp", 0.25), AuxTerm("moe/aux_loss", 0.01, "layer"),
                          AuxTerm("moe/z_loss", 0.001, "layer"))
    dense = objective_for(Transformer(load_config("tiny-gpt").model), cross_entropy_sum)
    assert dense.terms == ()


def test_the_mtp_objective_weighs_each_module_by_its_own_targets():
    loss = Loss(cross_entropy_sum, mtp_weight=0.5)
    main, sums, scale = torch.tensor(10.0), torch.tensor([4.0, 6.0]), torch.tensor([2.0, 1.0])
    assert float(loss.objective(main, sums, scale)) == pytest.approx(10.0 + 0.25 * (8.0 + 6.0))
    assert float(loss.objective(main)) == 10.0
