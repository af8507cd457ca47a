"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) against transformers' random-initialised tiny models whose
sequences are longer than the indexer's top-k: logits on a padded fp32 batch, round trips both ways, export, greedy
generation with the indexer cache; the published DeepSeek-V3.2 config as the bundled one; the refusals."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch
from helpers.hf_models import assert_batched_greedy_equals_generate, hf_model

from meshformer.checkpointing.hf import (
    check_compatible,
    config_from_hf,
    config_to_hf,
    from_hf_model,
    from_hf_state_dict,
    infer_arch,
)
from meshformer.config import load_config
from meshformer.model import Transformer
from meshformer.model.flops import count_params

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ["deepseek_v32", "glm_moe_dsa"]
T, NEW_TOKENS = 14, 8


@torch.no_grad()
def _perturb(module: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter moved, norms and the indexer's LayerNorm bias included; the routers' selection bias (a
    buffer) set nonzero."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    for name, buffer in module.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))


def _saved(hf) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(hf, dict(hf.state_dict()))


@pytest.mark.parametrize("arch", ARCHS)
def test_import_logits_round_trip_and_export(arch):
    """Import: logits within 1e-4 at the real tokens (the indexer's selection bites: 6 of up to 14 keys); both
    round trips bitwise; the export computes our logits in transformers."""
    hf = hf_model(arch)
    _perturb(hf)
    ours = from_hf_model(hf).eval()
    assert infer_arch(ours.cfg) == arch and ours.cfg.layer_types == ["dsa"] and ours.cfg.dsa.topk == 6
    ids, mask = padded_batch(4096, T, left=False)
    real = mask.bool()
    got = assert_import_exact(hf, ours, ids, mask)
    with torch.no_grad():
        dense = dataclasses.replace(ours.cfg, dsa=dataclasses.replace(ours.cfg.dsa, topk=T))
        unselected = Transformer(dense).eval()
        unselected.load_state_dict(ours.state_dict())
        assert (unselected(ids, real)[real] - got[real]).abs().max() > 1e-2  # sparsity is exercised
    assert_export_exact(ours, ids, mask)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_transformers_generate(arch):
    """Left-padded prompts of 3, 9 and 6 tokens and 8 new ones: the later steps read more keys than top-k, from
    the indexer cache (and without a cache: the whole forward)."""
    assert_batched_greedy_equals_generate(arch, NEW_TOKENS)


V32_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_published_config_is_the_bundled_one_and_counts_what_transformers_builds():
    """deepseek-ai/DeepSeek-V3.2's config.json values (transformers' defaults but these): the bundled config, its
    count equal to transformers' meta-device model's (671B: the published 685B adds the MTP layer's 14B), and back."""
    published = transformers.DeepseekV32Config(max_position_embeddings=163840, rope_parameters=V32_ROPE)
    cfg = config_from_hf(published)
    bundled = load_config("deepseek-v3.2").model
    training_only = ("aux_loss", "aux_per_sequence", "router_bias_update_rate")
    assert cfg == dataclasses.replace(bundled, mtp=cfg.mtp, moe=dataclasses.replace(
        bundled.moe, **{k: getattr(cfg.moe, k) for k in training_only}))
    with torch.device("meta"):
        hf = transformers.DeepseekV32ForCausalLM(published)
    counts = count_params(cfg)
    assert counts["total"] == sum(p.numel() for p in hf.parameters())
    assert abs(count_params(bundled)["total"] / 685e9 - 1) < 0.03  # with its MTP module
    back = config_to_hf(bundled)
    assert (back.rope_parameters, back.index_topk, back.index_n_heads, back.index_head_dim) == (
        published.rope_parameters, 2048, 64, 128)


@pytest.mark.parametrize(("arch", "extra", "named"), [
    ("deepseek_v32", {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]},
     "mlp_layer_types=['sparse', 'dense'"),
    ("deepseek_v32", {"attention_bias": True}, "attention_bias=True"),
], ids=["mlp-pattern", "attention-bias"])
def test_import_refuses_what_it_cannot_express(arch, extra, named):
    spec = {"deepseek_v32": transformers.DeepseekV32Config, "glm_moe_dsa": transformers.GlmMoeDsaConfig}[arch]
    with pytest.raises(ValueError, match=re.escape(named)):
        config_from_hf(spec(num_hidden_layers=4, **extra))


def test_fp8_checkpoints_are_refused_and_architectures_refuse_each_others_models():
    hf = hf_model("deepseek_v32")
    state = {**_saved(hf), "model.layers.0.self_attn.indexer.wk.weight_scale_inv": torch.ones(1)}
    with pytest.raises(ValueError, match=r"deepseek_v32: .*weight_scale_inv: .*quantization_config"):
        from_hf_state_dict(state, config_from_hf(hf.config), "deepseek_v32")
    cfg = config_from_hf(hf.config)
    with pytest.raises(ValueError, match="kind 'dsa'"):
        check_compatible(cfg, "deepseek_v3")
    with pytest.raises(ValueError, match="indexer_rope_interleave=False"):
        check_compatible(cfg, "glm_moe_dsa")
    with pytest.raises(ValueError, match="dsa=False"):
        check_compatible(load_config("tiny-deepseek").model, "deepseek_v32")


def test_the_mtp_layer_and_its_indexer_cross_both_ways_bitwise():
    """tiny-dsa's MTP module as layer num_hidden_layers, its block's indexer included; read back bitwise."""
    from meshformer.checkpointing.hf import to_hf_state_dict

    cfg = load_config("tiny-dsa", ["model.n_layers=2", 'model.mlp_types=["dense", "moe"]']).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    _perturb(model)
    state = to_hf_state_dict(model, "deepseek_v32")
    assert {"eh_proj.weight", "self_attn.indexer.wk.weight", "self_attn.indexer.k_norm.bias"} <= {
        k.removeprefix("model.layers.2.") for k in state if k.startswith("model.layers.2.")}
    assert config_to_hf(cfg, "deepseek_v32").num_nextn_predict_layers == 1
    ours = from_hf_state_dict(state, cfg, "deepseek_v32")
    expected = model.state_dict()
    assert set(ours) == set(expected) and all(torch.equal(v, expected[k]) for k, v in ours.items())
