"""The mixture-of-experts feed-forward (`model/moe.py`) as the channel-mixer kind `moe`, reading `[model.moe]`
(and `[model.ffn]`'s activation): a router, n_experts experts of which each token uses experts_per_token, and
shared experts every token uses."""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import FP32, INDEX, ActivationLayout, ChannelMixer, local_tokens
from meshformer.model.components.feed_forward import activation_factor, dense_matmuls, dense_params
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import SEQUENCE, TOKENS


def moe_rows(m: ModelConfig, x: ActivationLayout) -> tuple[int, float]:
    """(rows this rank sends to experts, rows its experts receive) per MoE layer and micro-batch (planner/
    activations.py): N k sent (capped by capacity); received as sent without expert parallelism, else the imbalance
    times sent, or the capacity bound, never above the dropless worst case ep N min(k, E / ep)."""
    n, k, experts = x.batch * local_tokens(x), m.moe.experts_per_token, m.moe.n_experts
    sent = n * k
    capacity = math.ceil(m.moe.capacity_factor * n * k / experts) if m.moe.capacity_factor > 0 else 0
    if capacity:
        sent = min(sent, experts * capacity)
    if x.ep == 1:
        return sent, float(sent)
    local = experts // x.ep
    most = x.ep * n * min(k, local)
    if capacity:
        return sent, float(min(most, x.ep * local * capacity))
    return sent, min(x.moe_imbalance * sent, float(most))


def shared_expert_gate(cfg: ModelConfig) -> int:
    """Weights of the shared experts' gate (moe.shared_expert_gate): one d_model -> 1 projection, no bias."""
    return cfg.d_model if cfg.moe.shared_expert_gate and cfg.moe.n_shared_experts else 0


class MixtureOfExperts(ChannelMixer):
    name = "moe"
    exports = frozenset({"moe.experts_per_token", "moe.d_ff", "moe.router_groups_per_token"})
    section = "moe"
    expert_parallel = True

    def build(self, cfg: ModelConfig) -> nn.Module:
        from meshformer.model.moe import MoEFeedForward

        return MoEFeedForward(cfg)

    def check(self, cfg: ModelConfig) -> None:
        if cfg.moe.n_experts == 0:
            raise ConfigError('model.mlp_types has "moe" blocks but model.moe.n_experts = 0',
                              "set model.moe.n_experts (e.g. 8), or make every block dense")

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # Sequence parallel throughout: each rank routes its own tokens and expert parallelism spans the
        # tensor-parallel ranks; the router, shared experts and their gate hold replicated weights whose gradients sum
        # over ranks.
        return {"router": TOKENS, "shared_expert_gate": SEQUENCE,
                **{f"shared_experts.{name}": SEQUENCE for name in ("gate_proj", "up_proj", "down_proj")}}

    def params(self, cfg: ModelConfig) -> tuple[int, int]:
        """Active: the router, experts_per_token routed experts and the shared experts, with the router's and
        experts' biases where present."""
        expert = dense_matmuls(cfg, cfg.expert_d_ff)
        if cfg.moe.expert_linear_bias:  # gate (if any) and up biases of width expert_d_ff, a down bias of width d_model
            expert += (2 if cfg.gated else 1) * cfg.expert_d_ff + cfg.d_model
        router = cfg.moe.n_experts * (cfg.d_model + int(cfg.moe.router_bias))
        common = router + dense_params(cfg, cfg.moe.n_shared_experts * cfg.expert_d_ff) + shared_expert_gate(cfg)
        return common + cfg.moe.n_experts * expert, common + cfg.moe.experts_per_token * expert

    def flops(self, cfg: ModelConfig, tokens: int) -> int:
        """The router and the experts one token passes: experts_per_token routed and the shared ones (and their
        gate)."""
        experts = cfg.moe.experts_per_token + cfg.moe.n_shared_experts
        return 2 * tokens * (cfg.moe.n_experts * cfg.d_model + experts * dense_matmuls(cfg, cfg.expert_d_ff)
                             + shared_expert_gate(cfg))

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """On this rank's N tokens: the router's fp32 input, the fp32 scores (and logits with a balance loss), the
        top-k and sort indices, the rows its experts receive and their activations, the expert outputs and weights
        the combine multiplies, and the shared experts as a dense feed-forward."""
        m, n, h, a = cfg, x.batch * local_tokens(x), cfg.d_model, x.bytes
        sent, received = moe_rows(m, x)
        factor = activation_factor(m)
        total: float = n * h * FP32  # the router's fp32 input (the normalised tokens when fp32)
        total += n * m.moe.n_experts * FP32 * (2 if m.moe.aux_loss or m.moe.router_z_loss else 1)  # scores (+ logits)
        total += n * m.moe.experts_per_token * (INDEX + FP32) + 2 * sent * INDEX  # top-k, weights; sort order, tokens
        if x.ep > 1:
            total += 2 * received * INDEX  # the regrouping of received rows and its inverse
        total += received * (h + factor * m.expert_d_ff) * a  # expert input rows and activations
        total += sent * (h * a + FP32)  # expert outputs and their weights, multiplied in the combine
        if m.moe.n_shared_experts:
            total += factor * n * m.moe.n_shared_experts * m.expert_d_ff * a + (n * h * a if a != FP32 else 0)
            if shared_expert_gate(m):  # the shared output and its sigmoid gate, multiplied
                total += n * (h + 1) * a
        return total

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """The router's and experts' matmul outputs, on this rank's tokens (sequence parallel routes locally)."""
        m, n, h, a = cfg, x.batch * local_tokens(x), cfg.d_model, x.bytes
        widths = 2 if m.gated else 1  # gate and up (or up) projection outputs
        _, received = moe_rows(m, x)
        total = n * m.moe.n_experts * FP32 + received * (widths * m.expert_d_ff + h) * a
        total += n * (widths * m.moe.n_shared_experts * m.expert_d_ff + h) * a if m.moe.n_shared_experts else 0
        return total

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout) -> float:
        """Its experts' activation gradients, those of the received rows and, arriving back all-to-all, of the sent
        ones; the loop back-propagates one expert's rows at a time (the balanced share of the received ones)."""
        sent, received = moe_rows(cfg, x)
        rows = received / max(1, cfg.moe.n_experts // x.ep) if x.experts_loop else received
        return ((3 if cfg.gated else 2) * rows * cfg.expert_d_ff + (received + sent) * cfg.d_model) * x.bytes


register(MixtureOfExperts())
