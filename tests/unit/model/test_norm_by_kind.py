"""model.norm.by_kind: a norm position per token-mixer kind (OLMo hybrid: post-sublayer norms on the attention
blocks, pre-norms on the Gated DeltaNet blocks), read from the TOML table, applied per block, and refused in one
line where it names no block's kind or meets the sandwich position."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from meshformer.config import ConfigError, config_from_dict
from meshformer.model import Transformer
from meshformer.model.masks import AttentionMask

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def config_with(**norm: Any):
    raw = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "position": "rope", "max_seq_len": 32,
                     "layer_types": ["linear_attention", "full_attention"],
                     "attention": {"n_heads": 4},
                     "linear_attention": {"n_heads": 2, "key_head_dim": 8, "value_head_dim": 8},
                     "norm": {"kind": "rmsnorm", **norm}},
           "data": {"seq_len": 16}}
    return config_from_dict(raw)


def test_each_block_takes_its_kinds_position():
    cfg = config_with(position="post_sublayer", by_kind={"linear_attention": "pre"}).model
    assert [cfg.block_norm_position(i) for i in range(4)] == ["pre", "post_sublayer"] * 2
    torch.manual_seed(0)
    model = Transformer(cfg).to(F64)
    linear, attention = model.decoder_layers["0"], model.decoder_layers["1"]
    assert (linear.attn_residual.position, attention.attn_residual.position) == ("pre", "post_sublayer")
    x = torch.randn(1, 5, 32, dtype=F64)
    mask = AttentionMask(None, is_causal=True)
    rope = model.rope(torch.arange(5))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
        h = x + linear.attn(linear.attn_norm(x))  # pre: x + f(norm(x))
        torch.testing.assert_close(linear(x, mask), h + linear.ffn(linear.ffn_norm(h)))
        h = x + attention.attn_norm(attention.attn(x, mask, rope=rope))  # post_sublayer: x + norm(f(x))
        torch.testing.assert_close(attention(x, mask, rope=rope), h + attention.ffn_norm(attention.ffn(h)))


@pytest.mark.parametrize("norm, message", [
    (dict(by_kind={"kda": "pre"}), "model.norm.by_kind names 'kda'"),
    (dict(position="sandwich", by_kind={"linear_attention": "pre"}), "cannot mix the sandwich"),
    (dict(by_kind={"linear_attention": "sandwich"}), "is not one of"),
    (dict(by_kind=["pre"]), "must be a table"),
])
def test_bad_by_kind_is_refused_in_one_line(norm: dict, message: str):
    with pytest.raises(ConfigError, match=message) as err:
        config_with(**norm)
    assert "\n" not in str(err.value)
