"""The `none` token-mixer and channel-mixer kinds: a block holds its one other sub-layer only (no module, norm or
branch), counts agree with the modules, a block starting with `none` still decodes from the right position, and a
block with neither mixer is refused."""

from __future__ import annotations

import pytest
import torch

from meshformer.config import load_config
from meshformer.config.validate import validate_model
from meshformer.errors import ConfigError
from meshformer.model import Transformer
from meshformer.model.flops import count_params
from meshformer.model.generate import greedy_decode, pad_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_mixer_each():
    cfg = load_config("tiny-gpt").model
    cfg.n_layers, cfg.d_model, cfg.vocab_size = 4, 32, 64
    cfg.layer_types = ["none", "full_attention", "none", "full_attention"]  # block 0: an MLP alone
    cfg.mlp_types = ["dense", "none", "dense", "none"]
    cfg.ffn.activation = "relu2"
    return cfg


def test_a_block_holds_only_its_other_sub_layer_and_counts_follow():
    cfg = _one_mixer_each()
    validate_model(cfg, "hf:test")
    model = Transformer(cfg)
    mlp, attention = model.decoder_layers["0"], model.decoder_layers["1"]
    assert mlp.attn is None and mlp.attn_norm is None and mlp.ffn is not None
    assert attention.ffn is None and attention.ffn_norm is None and attention.attn is not None
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    x = torch.randn(2, 5, cfg.d_model)
    with torch.no_grad():  # the MLP block is x + down(relu(up(norm(x)))²)
        expected = x + mlp.ffn.down_proj(torch.relu(mlp.ffn.up_proj(mlp.ffn_norm(x))) ** 2)
        torch.testing.assert_close(mlp(x, None), expected)


def test_cached_generation_from_a_block_without_token_mixer_equals_recomputing():
    """Block 0 keeps no cache: the position of the new tokens comes from the blocks that do (learned positions)."""
    torch.manual_seed(0)
    model = Transformer(_one_mixer_each()).eval()
    prompt, padding = pad_rows([[3, 14, 15, 9, 2, 6], [5, 3, 5]], 0)
    with torch.no_grad():
        cached = greedy_decode(model, prompt, 6, prompt_padding=padding)
        recomputed = greedy_decode(model, prompt, 6, prompt_padding=padding, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_a_block_with_neither_mixer_is_refused():
    cfg = _one_mixer_each()
    cfg.mlp_types = ["none", "none", "dense", "none"]
    with pytest.raises(ConfigError, match="block 0 has token mixer none and channel mixer none"):
        validate_model(cfg, "hf:test")
