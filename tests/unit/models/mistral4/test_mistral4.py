"""Mistral 4 (meshformer/models/mistral4/) against transformers' random-initialised Mistral4ForCausalLM whose prompts
cross several steps of Llama 4's query scaling: logits on a padded fp32 batch both ways, round trips bitwise, greedy
generation equal; the published config as the bundled one with transformers' parameter count; the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch
from helpers.hf_models import ARCHS, assert_batched_greedy_equals_generate, hf_model

from meshformer.checkpointing.hf import (
    check_compatible,
    config_from_hf,
    config_to_hf,
    from_hf_model,
    infer_arch,
)
from meshformer.config import ConfigError, load_config
from meshformer.model import Transformer
from meshformer.model.flops import count_params

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

T = 14  # past original_max_position_embeddings = 4 three times: queries scaled by 1, 1 + b ln 2, 1 + b ln 3, ...


@torch.no_grad()
def _perturbed(seed: int = 0) -> torch.nn.Module:
    """The tiny model of helpers.hf_models with every parameter moved (norms included)."""
    hf = hf_model("mistral4")
    gen = torch.Generator().manual_seed(seed)
    for p in hf.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return hf


def test_logits_both_ways_and_bitwise_round_trips():
    hf = _perturbed()
    ours = from_hf_model(hf).eval()
    cfg = ours.cfg
    assert infer_arch(cfg) == "mistral4"
    assert (cfg.mla.query_scale_beta, cfg.rope.original_max_seq_len, cfg.moe.router_score) == (0.5, 4, "softmax")
    assert [cfg.is_moe(i) for i in range(2)] == [False, True]
    ids, mask = padded_batch(4096, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    # the scaling is exercised: without it the logits move far beyond the tolerance
    unscaled = Transformer(dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, query_scale_beta=0.0))).eval()
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled(ids, real)[real] - got[real]).abs().max() > 1e-2
    # ours (perturbed) -> theirs computes our logits and comes back bitwise with the same config
    fresh = Transformer(cfg).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in fresh.parameters():
            p.normal_(0.0, 0.15, generator=gen)
    assert_export_exact(fresh, ids, mask)


def test_greedy_generation_equals_transformers():
    """Left-padded prompts (each row's positions, hence its query scales, counted from its first real token)."""
    assert_batched_greedy_equals_generate("mistral4", new_tokens=8)


def test_published_config_is_the_bundled_one():
    """transformers' Mistral4Config defaults are Mistral-Small-4-119B-2603's shape: the bundled config, with the
    parameter count of the model transformers builds from it on the meta device, and back with its rope keys."""
    published = transformers.Mistral4Config()
    cfg = config_from_hf(published)
    bundled = load_config("mistral-small-4").model
    assert cfg == dataclasses.replace(bundled, moe=dataclasses.replace(
        bundled.moe, **{k: getattr(cfg.moe, k) for k in ("aux_loss", "aux_per_sequence")}))
    with torch.device("meta"):
        model = transformers.Mistral4ForCausalLM(published)
    assert count_params(bundled)["total"] == sum(p.numel() for p in model.parameters()) == 118_972_826_624
    back = config_to_hf(bundled).rope_parameters
    assert {k: back[k] for k in published.rope_parameters if k != "type"} == {
        k: v for k, v in published.rope_parameters.items() if k != "type"}


def test_refusals():
    spec = {k: v for k, v in ARCHS["mistral4"].items() if k not in ("config", "model")}
    rope = {**spec["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=re.escape("rope_parameters.partial_rotary_factor=0.5")):
        config_from_hf(transformers.Mistral4Config(**{**spec, "rope_parameters": rope}))
    cfg = from_hf_model(hf_model("mistral4")).cfg
    check_compatible(cfg, "mistral4")
    with pytest.raises(ValueError, match="mla.query_scale_beta="):  # DeepSeek's attention lacks the scaling
        check_compatible(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_score="sigmoid")),
                         "deepseek_v3")
    with pytest.raises(ConfigError, match=re.escape("model.mla.query_scale_beta=0.1 scales queries")):
        load_config("tiny-deepseek", ["model.mla.query_scale_beta=0.1"])  # no original_max_seq_len
    with pytest.raises(ConfigError, match=re.escape("which dsa blocks")):
        load_config("tiny-dsa", ["model.mla.query_scale_beta=0.1", "model.rope.original_max_seq_len=64"])
