"""The dense feed-forward (`model/layers.py`'s FeedForward) as the channel-mixer kind `dense`, reading
`[model.ffn]`: d_model -> d_ff -> d_model, with a gate projection under a gated activation."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from meshformer.model.components import register
from meshformer.model.components.base import ActivationLayout, ChannelMixer, linear, local_tokens
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, GATHER, ROWWISE


def activation_factor(m: ModelConfig) -> int:
    """Tensors of the feed-forward's width its activation keeps: SwiGLU gate, up, silu(gate), product; GELU input
    and output; ReLU its output; squared ReLU its input and output; the clamped SwiGLU (gpt-oss) gate, up, their
    clamps (up + 1), sigmoid(alpha * gate), gate * sigmoid, product; the limited SwiGLU (DeepSeek-V4) gate, up, their
    clamps, silu, product."""
    if m.ffn.activation == "swiglu_clamped":
        return 7
    if m.ffn.activation == "swiglu_limited":
        return 6
    return 4 if m.gated else {"relu": 1}.get(m.ffn.activation, 2)


def dense_matmuls(cfg: ModelConfig, width: int) -> int:
    """Matmul weights of a feed-forward of hidden width `width`."""
    return (3 if cfg.gated else 2) * cfg.d_model * width


def dense_params(cfg: ModelConfig, width: int) -> int:
    """Parameters of a feed-forward of hidden width `width` (0: none)."""
    if not width:
        return 0
    gate = linear(cfg.d_model, width, cfg.bias) if cfg.gated else 0
    return gate + linear(cfg.d_model, width, cfg.bias) + linear(width, cfg.d_model, cfg.bias)


class Dense(ChannelMixer):
    name = "dense"

    def build(self, cfg: ModelConfig) -> nn.Module:
        from meshformer.model.layers import FeedForward

        return FeedForward(cfg)

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        return {"": GATHER, "gate_proj": COLWISE, "up_proj": COLWISE, "down_proj": ROWWISE}  # gate split as up

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        return [("model.ffn.d_ff", cfg.ffn.d_ff, "the feed-forward hidden size is split across ranks")]

    def params(self, cfg: ModelConfig) -> tuple[int, int]:
        dense = dense_params(cfg, cfg.ffn.d_ff)
        return dense, dense

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        return 2 * tokens * dense_matmuls(cfg, cfg.ffn.d_ff)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """The (gathered) normalised input and the activation's tensors of width d_ff / tp."""
        ffn = x.batch * x.seq * (cfg.ffn.d_ff // x.tp) * x.bytes
        return x.batch * x.seq * cfg.d_model * x.bytes + activation_factor(cfg) * ffn

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """Gate and up (or up) projection outputs; down_proj's output before and after the reduce-scatter."""
        b, s, t, a = x.batch, x.seq, x.tp, x.bytes
        total: float = (2 if cfg.gated else 1) * b * s * (cfg.ffn.d_ff // t) * a
        total += b * s * cfg.d_model * a
        if t > 1:
            total += b * local_tokens(x) * cfg.d_model * a
        return total

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return (3 if cfg.gated else 2) * x.batch * x.seq * (cfg.ffn.d_ff // x.tp) * x.bytes


register(Dense())
