"""DeepSeek-V4's hash-routed mixture of experts (`model/moe.py`'s `HashRoutedMoE`) as the channel-mixer kind
`hash_moe`, reading `[model.moe]` as the `moe` kind does: each token's experts_per_token experts are its token id's
row of a fixed table saved with the model (model.vocab_size rows); the router only weighs them (sqrt-softplus scores,
normalised, times moe.router_scale). The block passes it the token ids; under sequence parallel each rank takes
its slice of them, as of the tokens, and under context parallel those of its rank's pieces.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.mixture_of_experts import MixtureOfExperts
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import TOKEN_IDS


class HashRoutedExperts(MixtureOfExperts):
    name = "hash_moe"
    reads_token_ids: ClassVar[bool] = True

    def build(self, cfg: ModelConfig) -> nn.Module:
        from meshformer.model.moe import HashRoutedMoE

        return HashRoutedMoE(cfg)

    def check(self, cfg: ModelConfig) -> None:
        super().check(cfg)
        if cfg.moe.router_groups > 1 or cfg.moe.capacity_factor > 0:
            raise ConfigError("hash_moe blocks take each token's experts from a fixed table, but model.moe sets "
                              "router_groups or capacity_factor", "set router_groups = 1 and capacity_factor = 0")

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # under sequence parallel each rank routes its own tokens: the (whole) token ids are sliced alike
        return {**super().tp_rules(cfg), "": TOKEN_IDS}


register(HashRoutedExperts())
