"""Mistral 4 (meshformer/models/mistral4/) against transformers' random-initialised Mistral4ForCausalLM whose prompts
cross several steps of Llama 4's query scaling: logits on a padded fp32 batch both ways, round trips bitwise, greedy
generation equal; the published config as the bundled one with transformers' parameter count; the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.hf_models import ARCHS, assert_batched_greedy_equals_generate, hf_model

from meshformer.checkpointing.hf import (
    check_compatible,
    config_from_hf,
    config_to_hf,
    from_hf_model,
    infer_arch,
    to_hf_model,
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


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 4096, (3, T), generator=gen)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, 10:], mask[2, 4:] = 0, 0  # right padding
    return ids, mask


def test_logits_both_ways_and_bitwise_round_trips():
    hf = _perturbed()
    ours = from_hf_model(hf).eval()
    cfg = ours.cfg
    assert infer_arch(cfg) == "mistral4"
    assert (cfg.mla.query_scale_beta, cfg.rope.original_max_seq_len, cfg.moe.router_score) == (0.5, 4, "softmax")
    assert [cfg.is_moe(i) for i in range(2)] == [False, True]
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        expected, got = hf(input_ids=ids, attention_mask=mask).logits, ours(ids, real)
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-4)
    assert expected.std() > 0.1
    # the scaling is exercised: without it the logits move far beyond the tolerance
    unscaled = Transformer(dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, query_scale_beta=0.0))).eval()
    unscaled.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (unscaled(ids, real)[real] - expected[real]).abs().max() > 1e-2
    # theirs -> ours -> theirs: every tensor bitwise (the stacked experts included)
    back = to_hf_model(ours).state_dict()
    original = hf.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[k], v) for k, v in original.items())
    # ours (perturbed) -> theirs computes our logits and comes back bitwise with the same config
    fresh = Transformer(cfg).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in fresh.parameters():
            p.normal_(0.0, 0.15, generator=gen)
    exported = to_hf_model(fresh).eval()
    with torch.no_grad():
        theirs, mine = exported(input_ids=ids, attention_mask=mask).logits, fresh(ids, real)
    torch.testing.assert_close(theirs[real], mine[real], rtol=0, atol=1e-4)
    returned = from_hf_model(exported)
    assert returned.cfg == cfg
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in returned.state_dict().items())


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
    with pytest.raises(ValueError, match="mla_query_scale=True"):  # DeepSeek's attention lacks the scaling
        check_compatible(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, router_score="sigmoid")),
                         "deepseek_v3")
    with pytest.raises(ConfigError, match=re.escape("model.mla.query_scale_beta=0.1 scales queries")):
        load_config("tiny-deepseek", ["model.mla.query_scale_beta=0.1"])  # no original_max_seq_len
    with pytest.raises(ConfigError, match=re.escape("which dsa blocks")):
        load_config("tiny-dsa", ["model.mla.query_scale_beta=0.1", "model.rope.original_max_seq_len=64"])
