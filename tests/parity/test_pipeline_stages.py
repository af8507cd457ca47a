"""One forward: pipeline stages chained in one process compute exactly what the whole model computes.

A stage is the Transformer built for its span (holding only its pieces) plus the packing of its streams, so any split
(inside a stack, at the encoder/decoder boundary, one layer per stage) gives the same logits and the same
gradients as the unsplit model.
"""

from __future__ import annotations

import pytest
import torch
from helpers.parallel import make_batches, make_config, new_model

from meshformer.batch import model_inputs
from meshformer.loss.fused import head_loss_fn
from meshformer.model import Transformer
from meshformer.model.families import FAMILIES, get_family_spec
from meshformer.parallel.pipeline.stages import TransformerStage, split_layers, stage_pieces


def run_stages(stages: list[TransformerStage], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    carry: tuple[torch.Tensor, ...] = ()
    for stage in stages:
        out = stage(*carry, **inputs)
        carry = out if isinstance(out, tuple) else (out,)
    assert len(carry) == 1, "the last stage returns logits (or the loss) only"
    return carry[0]


@pytest.mark.parametrize(("family", "n_stages", "split"), [
    ("decoder", 2, None), ("decoder", 4, None), ("decoder_alibi", 3, [1, 3]),
    ("encoder", 2, None), ("encoder", 4, None),
    ("encdec", 2, None),  # split at the stack boundary
    ("encdec", 2, [3]),  # inside the decoder: memory travels with the decoder stream
    ("encdec", 2, [1]),  # inside the encoder: the embedded target rides along
    ("encdec", 4, None),  # one layer per stage
])
def test_stages_chained_equal_the_whole_model(family, n_stages, split):
    cfg = make_config(family)
    model = new_model(cfg).double()
    batch = make_batches(cfg, 1)[0]
    inputs = model_inputs(batch)
    spans = split_layers(model.spec.total_layers(cfg.model), n_stages, split)
    stages = [TransformerStage(model, span) for span in spans]

    expected = model(**inputs)
    got = run_stages(stages, inputs)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)

    expected.square().mean().backward()
    got.square().mean().backward()
    assert_stage_grads_equal(model, stages)


def assert_stage_grads_equal(model: torch.nn.Module, stages: list[TransformerStage]) -> None:
    grads = {name: p.grad for name, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}
    for stage in stages:  # a weight held by several stages (tied) gets the sum of their gradients
        for name, p in stage.named_parameters():
            canonical = stage.canonical_name(name)
            seen[canonical] = seen[canonical] + p.grad if canonical in seen else p.grad
    assert seen.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(seen[name], grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(("family", "n_stages"), [("decoder", 3), ("encoder", 2), ("encdec", 4)])
def test_last_stage_with_head_loss_returns_the_models_loss(family, n_stages):
    """With a fused head loss the last stage computes the loss from the labels (other stages ignore them)."""
    cfg = make_config(family)
    model = new_model(cfg).double()
    batch = make_batches(cfg, 1)[0]
    inputs = {**model_inputs(batch), "labels": batch["labels"]}
    head_loss = head_loss_fn("chunked", cfg.train.label_smoothing, cfg.train.z_loss)
    stages = [TransformerStage(model, span) for span in split_layers(model.spec.total_layers(cfg.model), n_stages)]
    stages[-1].head_loss = head_loss

    expected = model(**model_inputs(batch), labels=batch["labels"], head_loss=head_loss)
    got = run_stages(stages, inputs)
    assert got.dim() == 0
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    expected.backward()
    got.backward()
    assert_stage_grads_equal(model, stages)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_stages_hold_every_piece_once_except_shared_embeddings(name):
    cfg = make_config({"decoder": "decoder", "encoder": "encoder", "encoder_decoder": "encdec"}[name])
    model = new_model(cfg)
    spec = get_family_spec(name)
    spans = split_layers(spec.total_layers(cfg.model), 2)
    held = [{k for k, v in stage_pieces(model, span).items() if v is not None} for span in spans]
    assert {piece for piece in spec.pipeline.first if getattr(model, piece) is not None} <= held[0]
    assert {"output"} <= held[-1] and "output" not in held[0]
    assert {s.layers for s in spec.stacks} <= held[0] | held[1]


def test_a_stage_has_every_attribute_the_model_sets_in_init(monkeypatch):
    """A stage is built by Transformer.__init__: an attribute added there reaches every stage, and a stage has
    the model's attributes, buffers and submodule slots (pieces it does not hold are None)."""
    original = Transformer.__init__

    def init_with_a_new_attribute(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.new_attribute = ("set in __init__", self.cfg.d_model)

    monkeypatch.setattr(Transformer, "__init__", init_with_a_new_attribute)
    cfg = make_config("decoder_alibi")
    model = new_model(cfg)
    stages = [TransformerStage(model, span) for span in split_layers(model.spec.total_layers(cfg.model), 3)]
    def attribute_names(module: torch.nn.Module) -> set[str]:  # plain attributes, submodule slots, buffers
        return set(vars(module)) | set(module._modules) | set(module._buffers)

    for stage in stages:
        assert stage.new_attribute == model.new_attribute
        assert attribute_names(model) <= attribute_names(stage)
        assert stage._buffers.keys() == model._buffers.keys()
        torch.testing.assert_close(stage.alibi_slopes, model.alibi_slopes, rtol=0, atol=0)
