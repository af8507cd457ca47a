"""The empty sub-layer: token-mixer kind `none` (model.layer_types) and channel-mixer kind `none`
(model.mlp_types). A block whose token or channel mixer is `none` holds that sub-layer not at all (no module, no norm,
no residual branch), which expresses models whose layers hold one mixer each (Nemotron-H: a Mamba-2, attention, MLP
or MoE layer) as blocks of this project's two-mixer shape."""

from __future__ import annotations

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import ActivationLayout, ChannelMixer, TokenMixer
from meshformer.model.config import ModelConfig


class NoTokenMixer(TokenMixer):
    name = "none"
    empty = True
    blockwise_kernel = False
    qk_clip = False

    def check(self, cfg: ModelConfig) -> None:
        from meshformer.model.families import get_family_spec  # the families' formulas import this package

        for stack in get_family_spec(cfg.family).stacks:
            for block in range(stack.count(cfg)):
                if cfg.layer_type(block) == "none" and cfg.mlp_type(block) == "none" and not stack.cross:
                    raise ConfigError(f"model block {block} has token mixer none and channel mixer none, so it "
                                      "computes nothing", "give it a token or channel mixer in model.layer_types or "
                                      "model.mlp_types, or remove it (model.n_layers)")

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        raise TypeError("the `none` token mixer builds no module (the block skips it)")

    def rotary_width(self, cfg: ModelConfig) -> int:
        return cfg.attention_head_dim  # a RoPE stack's attention blocks set the table's width; this reads none

    def params(self, cfg: ModelConfig) -> int:
        return 0

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        return 0

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return 0.0

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        return 0.0

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        return 0.0


class NoChannelMixer(ChannelMixer):
    name = "none"
    empty = True

    def build(self, cfg: ModelConfig) -> nn.Module:
        raise TypeError("the `none` channel mixer builds no module (the block skips it)")

    def params(self, cfg: ModelConfig) -> tuple[int, int]:
        return 0, 0

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        return 0

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 0.0

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 0.0

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        return 0.0


register(NoTokenMixer())
register(NoChannelMixer())
