"""GLM-5's shared indexer (glm_moe_dsa with indexer_types "shared": those blocks reuse the nearest earlier full
block's key selection) against transformers' random-initialised tiny model whose sequences are longer than the
top-k: logits on a padded fp32 batch, round trips, export, greedy generation with the cache; the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch
from helpers.hf_models import assert_batched_greedy_equals_generate, hf_model

from meshformer.checkpointing.hf import check_compatible, config_from_hf, config_to_hf, from_hf_model, infer_arch
from meshformer.config.validate import validate_model
from meshformer.errors import ConfigError
from meshformer.model import Transformer
from meshformer.model.flops import count_params

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "glm_moe_dsa_shared"
T = 14
KINDS = ["dsa", "dsa_shared", "dsa_shared", "dsa"]


@torch.no_grad()
def _perturb(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    for p in module.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_shared_blocks_import_exactly_and_round_trip():
    """indexer_types F S S F: blocks 1 and 2 hold no indexer and attend to block 0's keys; logits within 1e-4 at the
    real tokens, round trips bitwise, the export computes ours in transformers; the count is transformers'."""
    hf = hf_model(ARCH)
    _perturb(hf)
    ours = from_hf_model(hf).eval()
    assert infer_arch(ours.cfg) == "glm_moe_dsa" and ours.cfg.layer_types == KINDS
    assert ours.decoder_layers["1"].attn.indexer is None and ours.decoder_layers["3"].attn.indexer is not None
    assert count_params(ours.cfg)["total"] == sum(p.numel() for p in hf.parameters())
    ids, mask = padded_batch(4096, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    assert_export_exact(ours, ids, mask)
    assert config_to_hf(ours.cfg, "glm_moe_dsa").indexer_types == ["full", "shared", "shared", "full"]
    with torch.no_grad():  # the shared blocks' selection bites: attending densely there changes the logits
        dense = dataclasses.replace(ours.cfg, dsa=dataclasses.replace(ours.cfg.dsa, topk=T))
        unselected = Transformer(dense).eval()
        unselected.load_state_dict(ours.state_dict())
        assert (unselected(ids, real)[real] - got[real]).abs().max() > 1e-2


def test_shared_blocks_greedy_equals_transformers_generate():
    """Left-padded prompts and 8 new tokens, with and without the cache (the shared blocks cache no indexer keys)."""
    assert_batched_greedy_equals_generate(ARCH, 8)


def test_refusals():
    """A first block that shares, an unknown indexer type; DeepSeek-V3.2 cannot export shared blocks; dsa_shared
    without a dsa block before it is refused before anything is built."""
    spec = transformers.GlmMoeDsaConfig
    with pytest.raises(ValueError, match=re.escape("indexer_types[0]='shared'")):
        config_from_hf(spec(num_hidden_layers=2, indexer_types=["shared", "full"]))
    with pytest.raises(ValueError, match=re.escape("indexer_types[1]='sparse'")):
        config_from_hf(spec(num_hidden_layers=2, indexer_types=["full", "sparse"]))
    cfg = config_from_hf(spec(num_hidden_layers=4, index_topk_freq=2))  # transformers' schedule: F F S F
    assert cfg.layer_types == ["dsa", "dsa", "dsa_shared", "dsa"]
    with pytest.raises(ValueError, match="indexer_shared=True"):
        check_compatible(cfg, "deepseek_v32")
    with pytest.raises(ConfigError, match="starts with 'dsa_shared'"):
        validate_model(dataclasses.replace(cfg, layer_types=["dsa_shared", "dsa"]), "test")
