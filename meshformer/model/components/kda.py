"""Kimi Delta Attention (`model/kda.py`, Kimi Linear's KDA) as the token-mixer kind `kda`, reading
`[model.linear_attention]` (n_heads, key_head_dim, value_head_dim, conv_width, chunk_size): Gated DeltaNet's kind
(`linear_attention`) with a forget gate per key channel, so it shares that kind's cache, document resets, context
parallel and head-split tensor parallel, and declares its own projections, parameters and initialisation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import FP32, ActivationLayout, InitFn, output_projection_bytes
from meshformer.model.components.linear_attention import LinearAttention, delta_rule_flops
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, HEAD_SHARD, ROWWISE

_BLOCK = 16  # the blocks of the per-channel within-chunk products (model/gated_delta.py: _channel_pair_products)


def kda_matmuls(cfg: ModelConfig) -> int:
    """Weights one token passes through: q, k, v, the forget gate's and the output gate's low-rank pairs, b, the
    output projection and the convolution's taps over q, k and v."""
    la, d = cfg.linear_attention, cfg.d_model
    key_dim, value_dim = la.n_heads * la.key_head_dim, la.n_heads * la.value_head_dim
    projections = d * (2 * key_dim + value_dim + la.n_heads) + value_dim * d
    gates = (d + key_dim) * la.key_head_dim + (d + value_dim) * la.value_head_dim
    return projections + gates + (2 * key_dim + value_dim) * la.conv_width


class KimiDeltaAttentionKind(LinearAttention):
    """KDA: a short causal convolution, the gated delta rule with a decay per key channel, a sigmoid-gated RMSNorm
    and the output projection."""

    name = "kda"

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.kda import KimiDeltaAttention

        return KimiDeltaAttention(cfg)

    def check(self, cfg: ModelConfig) -> None:
        la = cfg.linear_attention
        if la.key_heads != la.n_heads:
            raise ConfigError(f"model.linear_attention.n_key_heads={la.n_key_heads} differs from n_heads={la.n_heads}, "
                              "but kda blocks have a query and key head per value head",
                              "leave model.linear_attention.n_key_heads unset")
        super().check(cfg)

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # head-major rows: q, k, v, b and the gates' up-projections split colwise; the gates' down-projections are
        # replicated (their output's gradient is summed by the colwise up-projection)
        linears = ["q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj"]
        return {"": HEAD_SHARD, **dict.fromkeys(linears, COLWISE), "out_proj": ROWWISE}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        return [("model.linear_attention.n_heads", cfg.linear_attention.n_heads,
                 "KDA heads are split across tensor-parallel ranks")]

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        """transformers' Kimi Linear (flash-linear-attention's): A_log log(uniform(1, 16)), dt_bias the inverse
        softplus of exp(uniform(log 1e-3, log 1e-1)), the gated norm's scale 1; out_proj as Gated DeltaNet's."""
        if name == "A_log":
            return lambda t, g: t.uniform_(1.0, 16.0, generator=g).log_()
        if name == "dt_bias":
            def dt_bias(t, g):  # type: ignore[no-untyped-def]
                dt = t.uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp_().clamp_(min=1e-4)
                return t.copy_(dt + (-(-dt).expm1()).log())

            return dt_bias
        return super().init_rule(cfg, name)

    def params(self, cfg: ModelConfig) -> int:
        """The matmul weights and taps, A_log per head, dt_bias per key channel, the gated norm's weight (one value
        head wide). No biases."""
        la = cfg.linear_attention
        return kda_matmuls(cfg) + la.n_heads * (1 + la.key_head_dim) + la.value_head_dim

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """Projections and taps per token, and the chunked rule: Gated DeltaNet's (`delta_rule_flops`; the products
        across blocks are GEMMs of the same size), plus the within-block products computed channel by channel
        (2 products x C x S x Dk multiply-adds per chunk and head, S the block)."""
        la = cfg.linear_attention
        block = min(_BLOCK, la.chunk_size)
        within = 4 * block * la.key_head_dim * la.n_heads  # per token
        return 2 * queries * kda_matmuls(cfg) + queries * (delta_rule_flops(cfg) + within)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """Gated DeltaNet's (its projections, convolution, rule and gated norm), plus per token the forget gate's f
        (its low-rank input and key-channel output) and, in float32 per head and padded token, the per-channel decays
        (4 forms) and the within-block products' (S x Dk) factors; within 12% of what the graph keeps
        (tests/unit/model/test_kda.py, float32 and bf16 autocast)."""
        la, t = cfg.linear_attention, x.tp
        heads, dk = la.n_heads // t, la.key_head_dim
        padded = -(-x.seq // la.chunk_size) * la.chunk_size
        block = min(_BLOCK, la.chunk_size)
        per_token = (la.key_head_dim + heads * dk) * x.bytes + la.value_head_dim * x.bytes
        channels = heads * padded * dk * (4 + 2 * block) * FP32
        return super().saved_bytes(cfg, x, memory_len=memory_len, causal=causal) + x.batch * (
            x.seq * per_token + channels)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """What the selective policy keeps (parallel/recompute.py: the matmul outputs). Per token in the activation
        dtype: q, k, v, the forget gate's and the output gate's low-rank pairs (the down-projections whole on every
        rank) and b. In float32 per head and token padded to whole chunks of C: the two C x C products (K K^T,
        Q K^T), the per-channel blocks' two S-wide columns, W_k (Dk wide) and three Dv-wide products (W_v, the
        updates, the output). And out_proj's output. Equal to the measurement (tests/unit/planner/
        test_recurrent_selective_bytes.py, float32 and bf16 autocast)."""
        la, t = cfg.linear_attention, x.tp
        heads, dk, dv, chunk = la.n_heads // t, la.key_head_dim, la.value_head_dim, la.chunk_size
        padded = -(-x.seq // chunk) * chunk
        per_token = (3 * heads * dk + 2 * heads * dv + dk + dv + heads) * x.bytes
        rule = heads * padded * (2 * chunk + 2 * min(_BLOCK, chunk) + dk + 3 * dv) * FP32
        return x.batch * (x.seq * per_token + rule) + output_projection_bytes(cfg, x)


register(KimiDeltaAttentionKind())
