"""The family registry: every family answers the questions the rest of the tree asks (a new one: test_new_family.py)."""

from __future__ import annotations

import pytest
from helpers.parallel import make_config

from meshformer.model.families import FAMILIES, get_family_spec
from meshformer.model.flops import count_params

HARNESS_NAME = {"decoder": "decoder", "encoder": "encoder", "encoder_decoder": "encdec"}


def test_unknown_family_is_named_with_the_registered_ones():
    with pytest.raises(ValueError, match="registered families: \\['decoder', 'encoder', 'encoder_decoder'\\]"):
        get_family_spec("moe")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_spec_stacks_match_the_built_model(name):
    from meshformer.model import Transformer

    cfg = make_config(HARNESS_NAME[name]).model
    spec, model = get_family_spec(name), Transformer(cfg)
    assert spec.has_encoder == (model.encoder_layers is not None)
    assert spec.has_decoder == (model.decoder_layers is not None)
    assert [i for i, _ in spec.blocks(model)] == list(range(spec.total_layers(cfg)))
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    blocks = [block for _, block in spec.blocks(model)]
    assert all((block.cross_attn is not None) == spec.seq2seq for block in blocks if block.attn.causal)
