"""Attention heatmaps and the per-parameter gradient-norm report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.inspect import attention_heatmap, attention_weights, gradient_norms, gradient_report

pytestmark = pytest.mark.usefixtures("one_thread")



def tiny(**extra) -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_from_flat(vocab_size=30, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_seq_len=16,
                                       **extra))


def test_attention_weights_are_causal_distributions_of_the_chosen_layer():
    model = tiny(n_kv_heads=2)
    ids = torch.randint(0, 30, (2, 6))
    weights = attention_weights(model, ids, layer=1)
    assert weights.shape == (2, 4, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 6))
    assert weights.triu(1).abs().max() == 0  # no query looks at a later key
    assert not torch.equal(weights, attention_weights(model, ids, layer=0))
    assert model.decoder_layers["1"].attn.capture_weights is False  # the hook is switched off again
    with pytest.raises(ValueError, match="layer 5"):
        attention_weights(model, ids, layer=5)


def test_cross_attention_weights_ignore_padded_source():
    model = tiny(family="encoder_decoder")
    src, tgt = torch.randint(0, 30, (1, 7)), torch.randint(0, 30, (1, 4))
    padding = torch.tensor([[1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    weights = attention_weights(model, src, layer=0, attention_mask=padding, decoder_input_ids=tgt)
    assert weights.shape == (1, 4, 4, 7) and weights[..., 5:].abs().max() == 0


@pytest.mark.parametrize(("family", "stack"), [("decoder", None), ("encoder", None), ("encoder_decoder", "cross"),
                                               ("encoder_decoder", "encoder")])
def test_heatmap_png_has_the_requested_size(tmp_path, family, stack):
    model = tiny(family=family)
    ids = torch.randint(0, 30, (1, 9))
    tokens = [f"tok{i}" for i in range(9)]
    kwargs = {}
    if model.spec.seq2seq:
        kwargs = dict(decoder_input_ids=ids[:, :5], decoder_tokens=tokens[:5])
    path = attention_heatmap(model, ids, tmp_path / "maps" / "attn.png", layer=1, head=3, stack=stack,
                             tokens=tokens, size_px=(640, 480), **kwargs)
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (640, 480)
        pixels = torch.from_numpy(np.asarray(image.convert("L"), dtype=np.float32))
    assert pixels.std() > 10  # a drawn figure, not a blank canvas


def test_gradient_report_matches_manual_norms():
    model = tiny(tie_embeddings=True)
    ids = torch.randint(0, 30, (2, 8))
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 30), ids[:, 1:].reshape(-1)).backward()
    model.decoder_layers["0"].ffn.up_proj.bias.grad = None  # one parameter without a gradient
    text, norms = gradient_report(model)
    assert norms == gradient_norms(model)
    params = dict(model.named_parameters())
    assert set(norms) == set(params) and "output.weight" not in norms  # the tied head is listed once
    for name, p in params.items():
        if p.grad is None:
            assert norms[name] is None
            continue
        manual = math.sqrt(sum(float(g) ** 2 for g in p.grad.double().flatten()))
        assert norms[name] == pytest.approx(manual, rel=1e-5)
    total = math.sqrt(sum(n * n for n in norms.values() if n is not None))
    clip_total = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1e9)
    assert total == pytest.approx(float(clip_total), rel=1e-5)
    lines = text.splitlines()
    assert len(lines) == len(params) + 2  # header, one row per parameter, total
    assert "no grad" in next(line for line in lines if line.startswith("decoder_layers.0.ffn.up_proj.bias"))
    assert f"{total:.4e}" in lines[-1]
    by_norm, _ = gradient_report(model, sort_by_norm=True)
    first = by_norm.splitlines()[1].split()[0]
    assert norms[first] == max(n for n in norms.values() if n is not None)
