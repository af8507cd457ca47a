"""Layer-local loss terms (meshformer/loss/layer_terms.py): the objective, not the layer or its config, weighs the
MoE balance terms, and the run log's parts of them are the ones the objective declares."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.loss.objective import AuxTerm, Loss
from meshformer.model import Transformer
from meshformer.model.config import AttentionConfig, FfnConfig, ModelConfig, MoeConfig
from meshformer.model.init import init_weights
from meshformer.parallel.parallel_model import ParallelModel

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = ModelConfig(vocab_size=61, d_model=16, n_layers=2, max_seq_len=16, attention=AttentionConfig(n_heads=2),
                  ffn=FfnConfig(d_ff=32, activation="swiglu"),
                  moe=MoeConfig(n_experts=4, experts_per_token=2, d_ff=16, aux_loss=0.01, router_z_loss=0.001))


def _model(cfg: ModelConfig) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model.named_parameters(), cfg, 0)
    return model


def _router_grads(model: Transformer, loss: Loss | None = None) -> dict[str, torch.Tensor]:
    plan = ParallelModel(model, loss or cross_entropy_sum, torch.device("cpu"))
    ids = torch.randint(0, CFG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    plan.forward_backward({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, torch.tensor(16.0))
    return {name: p.grad.clone() for name, p in model.named_parameters() if "router" in name}


def _objective(aux: float, z: float) -> Loss:
    return Loss(cross_entropy_sum, layer_terms=(AuxTerm("moe/aux_loss", aux, "layer"),
                                                AuxTerm("moe/z_loss", z, "layer")))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-9)


def test_the_objective_not_the_config_weighs_the_moe_terms():
    model = _model(CFG)
    config_weights = _router_grads(copy.deepcopy(model))  # the default objective: model.moe's weights
    # a custom objective overrides them: the gradient of a model configured with its weights
    tenfold = _router_grads(copy.deepcopy(model), _objective(0.1, 0.01))
    configured = _model(replace(CFG, moe=replace(CFG.moe, aux_loss=0.1, router_z_loss=0.01)))
    _assert_same(tenfold, _router_grads(configured))
    zeroed = _router_grads(copy.deepcopy(model), _objective(0.0, 0.0))
    _assert_same(zeroed, _router_grads(_model(replace(CFG, moe=replace(CFG.moe, aux_loss=0.0, router_z_loss=0.0)))))
    # the terms reach the router: each weighting gives another gradient
    for name in zeroed:
        assert not torch.allclose(config_weights[name], zeroed[name])
        assert not torch.allclose(tenfold[name], config_weights[name])


def test_the_logged_parts_are_the_objectives():
    model = _model(CFG)
    only_aux = Loss(cross_entropy_sum, layer_terms=(AuxTerm("moe/aux_loss", 0.0, "layer"),))
    plan = ParallelModel(model, only_aux, torch.device("cpu"))
    ids = torch.randint(0, CFG.vocab_size, (2, 9))
    plan.forward_backward({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, torch.tensor(16.0))
    scalars = plan.moe_scalars()
    layers = {key.split("/")[1] for key in scalars}
    assert layers == {"decoder_layers.0", "decoder_layers.1"}
    for layer in layers:
        assert f"moe/{layer}/aux_loss" in scalars and f"moe/{layer}/load_max_over_mean" in scalars
        assert f"moe/{layer}/z_loss" not in scalars  # not declared: not logged
    stats = plan.moe_layers[0].last_stats
    assert scalars["moe/decoder_layers.0/aux_loss"] == pytest.approx(float(stats.aux_loss))
    # the default objective declares both terms, logged even at weight 0
    default = ParallelModel(_model(replace(CFG, moe=replace(CFG.moe, router_z_loss=0.0))), cross_entropy_sum,
                            torch.device("cpu"))
    default.forward_backward({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, torch.tensor(16.0))
    assert "moe/decoder_layers.1/z_loss" in default.moe_scalars()
