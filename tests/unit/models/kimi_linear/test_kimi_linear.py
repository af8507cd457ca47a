"""Kimi Linear (meshformer/models/kimi_linear/) against transformers' KimiLinearForCausalLM, random-initialised: logits
on a padded fp32 batch both ways, state dicts round trip bitwise, the published checkpoints' spellings read, the
published config maps both ways with transformers' parameter count, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.exactness import assert_export_exact, assert_import_exact, padded_batch
from torch import nn

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

PUBLISHED_LAYERS = [4, 8, 12, 16, 20, 24, 27]  # linear_attn_config.full_attn_layers (1-based)


def _hf_kimi(**extra) -> nn.Module:
    """KDA, KDA, MLA (queries through one projection), KDA; block 0 dense, then 8 experts in 2 groups of which each
    token keeps 1, top-2 sigmoid scores renormalised and scaled, one shared expert; a chunk (64) longer than the batch;
    every weight perturbed and a nonzero selection bias."""
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 12,
        "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "num_local_experts": 8,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "linear_num_heads": 2,
        "linear_head_dim": 8, "max_position_embeddings": 32, "layer_types": [
            "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, **extra}))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return hf.eval()


def test_logits_both_ways_and_bitwise_round_trips():
    hf = _hf_kimi()
    ours = from_hf_model(hf).eval()
    assert ours.cfg.layer_types == ["kda", "kda", "mla", "kda"] and ours.cfg.position == "none"
    assert [ours.cfg.is_moe(i) for i in range(4)] == [False, True, True, True]
    assert infer_arch(ours.cfg) == "kimi_linear"
    ids, mask = padded_batch(97)
    assert_import_exact(hf, ours, ids, mask)
    # ours (perturbed) -> theirs computes our logits, and comes back bitwise with the same config
    mine = Transformer(ours.cfg).eval()
    with torch.no_grad():
        for p in mine.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert_export_exact(mine, ids, mask)


def test_saved_and_published_spellings_are_read(tmp_path):
    """save_pretrained's names (q/k/v convolutions apart, A_log (1, 1, H, 1), every feed-forward under
    block_sparse_moe) and the published checkpoints' mlp.* for the dense block give the same weights."""
    from safetensors.torch import load_file

    hf = _hf_kimi()
    hf.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["model.layers.0.self_attn.A_log"].shape == (1, 1, 2, 1)
    assert "model.layers.0.self_attn.q_conv1d.weight" in saved and "model.layers.0.block_sparse_moe.up_proj.weight" \
        in saved
    cfg = config_from_hf(hf.config)
    ours = from_hf_state_dict(saved, cfg, "kimi_linear")
    published = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in saved.items()}
    assert "model.layers.0.mlp.gate_proj.weight" in published
    again = from_hf_state_dict(published, cfg, "kimi_linear")
    assert all(torch.equal(again[k], v) for k, v in ours.items())
    assert torch.equal(ours["decoder_layers.0.attn.A_log"], saved["model.layers.0.self_attn.A_log"].flatten())


def test_published_config_maps_both_ways_with_transformers_count():
    """moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json values (no download) give the bundled config, whose
    parameter count the model transformers builds on the meta device has, and come back."""
    published = transformers.KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
        num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_token=8, num_shared_experts=1,
        moe_renormalize=True, routed_scaling_factor=2.446, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
        rms_norm_eps=1e-5, model_max_length=1048576, tie_word_embeddings=False, hidden_act="silu",
        linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                            "full_attn_layers": PUBLISHED_LAYERS,
                            "kda_layers": [i for i in range(1, 28) if i not in PUBLISHED_LAYERS]})
    cfg = config_from_hf(published)
    bundled = load_config("kimi-linear-48b-a3b").model
    assert cfg.layer_types == bundled.layer_types and cfg.mlp_types == bundled.mlp_types
    # training choices of the bundled file (the selection bias's update rate) are not in config.json
    assert cfg == replace(bundled, moe=replace(bundled.moe, router_bias_update_rate=0.0))
    with torch.device("meta"):
        hf = transformers.KimiLinearForCausalLM(published)
    counts = count_params(bundled)
    assert counts["total"] == sum(p.numel() for p in hf.parameters()) == 49_122_675_072
    assert counts["active"] == 3_484_453_248  # "A3B": 3.1B without the input embedding table
    back = config_to_hf(bundled)
    assert back.layer_types == published.layer_types and back.mlp_layer_types == published.mlp_layer_types


@pytest.mark.parametrize(("extra", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_import_refuses_what_it_cannot_express(extra, named):
    with pytest.raises(ValueError, match=f"kimi_linear: {named}"):
        config_from_hf(_hf_kimi(**extra).config)


def test_export_refuses_what_it_lacks():
    cfg = config_from_hf(_hf_kimi().config)
    cfg.linear_attention.value_head_dim = 16
    with pytest.raises(ValueError, match="kda_equal_head_widths=False"):
        check_compatible(cfg, "kimi_linear")
    with pytest.raises(ValueError, match="kind 'kda'"):  # the other architectures refuse kda blocks
        check_compatible(load_config("tiny-kimi-linear").model, "deepseek_v3")
