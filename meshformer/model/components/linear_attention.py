"""Gated DeltaNet (`model/linear_attention.py`, Qwen3-Next's `linear_attn`) as the token-mixer kind `linear_attention`,
reading `[model.linear_attention]`: a recurrent state per value head instead of attention over keys, so it reads the
padding and packed documents of its tokens rather than a mask, and keeps a state of constant size when generating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.base import (
    FP32,
    ActivationLayout,
    GenerationCache,
    InitFn,
    TokenMixer,
    output_projection_bytes,
)
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, HEAD_SHARD, ROWWISE


def _widths(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key width, value width): all heads' together."""
    la = cfg.linear_attention
    return la.key_heads * la.key_head_dim, la.n_heads * la.value_head_dim


def linear_attention_matmuls(cfg: ModelConfig) -> int:
    """Weights one token passes through: the input projections (q, k, v, the output gate z, b and a per value head),
    the output projection and the convolution's taps over q, k and v."""
    la = cfg.linear_attention
    key_dim, value_dim = _widths(cfg)
    projections = cfg.d_model * (2 * key_dim + 2 * value_dim + 2 * la.n_heads) + value_dim * cfg.d_model
    return projections + (2 * key_dim + value_dim) * la.conv_width


def delta_rule_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs per token of the chunked gated delta rule (model/gated_delta.py) over every value head, with
    C = chunk_size, Dk, Dv the head widths: per chunk and head, K K^T, Q K^T (C^2 Dk each), the triangular
    inverse (C^3 / 2), W_v and W_k (C^2 Dv, C^2 Dk), the state read and write of the scan (2 C Dk Dv), the
    outputs P U (C^2 Dv) and Q S (C Dk Dv); 2 FLOPs a multiply-add, divided by the C tokens of the chunk."""
    la = cfg.linear_attention
    chunk, dk, dv = la.chunk_size, la.key_head_dim, la.value_head_dim
    per_chunk = chunk * chunk * (3 * dk + 2 * dv) + chunk ** 3 // 2 + 3 * chunk * dk * dv
    return 2 * per_chunk * la.n_heads // chunk


def check_recurrent_sizes(cfg: ModelConfig, kind: str, section: str, keys: tuple[str, ...]) -> None:
    """What every recurrent token mixer refuses: a family with a bidirectional encoder (the scan runs causally), and
    any of `keys` of model.<section> below 1."""
    from meshformer.model.families import get_family_spec  # the families' formulas import this package

    if get_family_spec(cfg.family).has_encoder:
        raise ConfigError(f"model.layer_types has {kind} blocks, which run causally, but family {cfg.family!r} "
                          "has a bidirectional encoder", 'use family = "decoder"')
    fields = getattr(cfg, section)
    for key in keys:
        if getattr(fields, key) < 1:
            raise ConfigError(f"model.{section}.{key}={getattr(fields, key)} must be positive")


def residual_output_init(cfg: ModelConfig) -> InitFn | None:
    """A recurrent mixer's out_proj as a residual output: normal(init_std / sqrt(2 layers)); under Xavier, None (the
    general rule)."""
    if cfg.init.method == "xavier":
        return None
    from meshformer.model.families import get_family_spec

    std = cfg.init.std / math.sqrt(2 * get_family_spec(cfg.family).total_layers(cfg))
    return lambda t, g: nn.init.normal_(t, std=std, generator=g)


class LinearAttention(TokenMixer):
    """Gated DeltaNet: a short causal convolution, then the gated delta rule per value head, a gated RMSNorm and
    the output projection."""

    name = "linear_attention"
    exports = frozenset({"linear_attention.n_heads", "linear_attention.n_key_heads", "linear_attention.key_head_dim",
                         "linear_attention.value_head_dim", "linear_attention.conv_width",
                         "linear_attention.projections"})
    section = "linear_attention"
    reads_padding_and_documents = True
    # blockwise_kernel stays as declared for attention: it has no softmax, and the attention blocks beside it pick
    # their kernel themselves
    qk_clip = False  # no attention logits for MuonClip to record or clip

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.linear_attention import GatedDeltaNet

        return GatedDeltaNet(cfg)

    def check(self, cfg: ModelConfig) -> None:
        la = cfg.linear_attention
        check_recurrent_sizes(cfg, "linear_attention", "linear_attention",
                              ("n_heads", "key_head_dim", "value_head_dim", "conv_width", "chunk_size"))
        if wide := [k for k in ("key_head_dim", "value_head_dim") if getattr(la, k) > cfg.d_model]:
            raise ConfigError(f"model.linear_attention.{wide[0]}={getattr(la, wide[0])} is wider than model.d_model="
                              f"{cfg.d_model}", "a head's keys and values are projections of the d_model-wide "
                              "residual stream and span at most d_model directions; use head widths <= d_model "
                              "(Qwen3-Next: 128 at d_model=2048)")
        if la.backend == "fla":
            from meshformer.model.gated_delta_fla import FLA_EXTRA, fla_importable

            if not fla_importable():
                raise ConfigError(f"{FLA_EXTRA} (not installed here)",
                                  'install it, or set model.linear_attention.backend = "auto" or "torch"')
        if la.key_heads < 1 or la.n_heads % la.key_heads:
            raise ConfigError(f"model.linear_attention.n_key_heads={la.n_key_heads} must divide n_heads={la.n_heads} "
                              "(each query/key head serves a group of value heads)",
                              "choose n_key_heads dividing n_heads, or leave it unset (= n_heads)")

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # Rows of the grouped projections, of z, b, a and of A_log / dt_bias are head-major: colwise splits give
        # each rank whole key-head groups. The [q | k | v]-ordered convolution (and in_proj_qkv) stay whole on every
        # rank, which picks its heads' channels (model/linear_attention.py: shard_heads).
        linears = {"split": ["in_proj_z", "in_proj_b", "in_proj_a"], "grouped": ["in_proj_qkvz", "in_proj_ba"],
                   "separate": ["in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a"]
                   }[cfg.linear_attention.projections]
        return {"": HEAD_SHARD, **dict.fromkeys(linears, COLWISE), "out_proj": ROWWISE}

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # each rank runs whole sequences of its heads: no state crosses ranks, so cp must split the heads evenly
        la = cfg.linear_attention
        for key, heads in (("n_heads", la.n_heads), ("n_key_heads", la.key_heads)):
            if (heads // tp) % cp:
                return (f"parallel.cp_method='ulysses' splits each rank's {heads // tp} {self.name} heads "
                        f"(model.linear_attention.{key}={heads} / tp={tp}) over cp={cp}, which does not divide them; "
                        "choose cp (and tp) so that cp x tp divides them, or use parallel.cp_method='allgather'")
        return None

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        la = cfg.linear_attention
        why = "Gated DeltaNet heads are split across tensor-parallel ranks"
        return [("model.linear_attention.n_heads", la.n_heads, why),
                ("model.linear_attention.n_key_heads", la.key_heads, why)]

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        """transformers' Qwen3-Next: dt_bias 1, A_log log(uniform(0.01, 16)), the gated norm's scale 1 (no weight
        offset); out_proj as a residual output (normal(init_std / sqrt(2 layers)), or Xavier)."""
        if name == "dt_bias":
            return lambda t, g: t.fill_(1.0)
        if name == "A_log":
            return lambda t, g: t.uniform_(0.01, 16.0, generator=g).log_()
        if name == "norm.weight":
            return lambda t, g: t.fill_(1.0)
        if name == "out_proj.weight":
            return residual_output_init(cfg)
        return None

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.linear_attention import LinearCache

        return LinearCache()

    def cache_per_token(self, cfg: ModelConfig) -> int:
        """0: its cache does not grow with the tokens. It holds, per sequence, the convolution's last conv_width - 1
        inputs (2 key widths + the value width each) and the (key_head_dim x value_head_dim) state of every value
        head, whatever the length."""
        return 0

    # ---------------------------------------------------------------- parameters and FLOPs

    def params(self, cfg: ModelConfig) -> int:
        """The matmul weights and taps, A_log and dt_bias per value head, the gated norm's weight (one value head
        wide, shared by the heads). No biases."""
        la = cfg.linear_attention
        return linear_attention_matmuls(cfg) + 2 * la.n_heads + la.value_head_dim

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """Its projections and taps over every token, and the chunked delta rule per token (`delta_rule_flops`): linear
        in the length, no keys."""
        return 2 * queries * linear_attention_matmuls(cfg) + queries * delta_rule_flops(cfg)

    # ---------------------------------------------------------------- activations (planner/activations.py)

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """What its autograd graph keeps (read off `saved_tensors_hooks`). In the activation dtype, per token: the
        normalised input, the convolution's input, its padded window and its output, out_proj's input. In float32
        per token: b, a and the decay's terms per value head, the gated norm's input, output, gate, silu(gate) and
        product. In float32 per value head and token of the sequence padded to whole chunks of C: the delta rule's
        q and k (repeated to every value head) in the 12 forms its products keep, v (copied to float32 from half
        precision), beta v, W_v and the updates, 7 rows of C x C within-chunk tensors (decays, K K^T, its inverse,
        Q K^T) and 7 scalars; and each chunk's (key_head_dim x value_head_dim) entering state, plus the final
        one. Within 12% of the measurement (tests/unit/model/test_linear_attention.py): which of these share storage
        through views depends on the shapes. Under tensor parallel every term but the (gathered) input is this
        rank's heads'."""
        la, b, s, a, t = cfg.linear_attention, x.batch, x.seq, x.bytes, x.tp
        key_dim, value_dim = (width // t for width in _widths(cfg))
        channels = 2 * key_dim + value_dim
        chunk, heads, dk, dv = la.chunk_size, la.n_heads // t, la.key_head_dim, la.value_head_dim
        chunks = -(-s // chunk)
        per_token = (cfg.d_model + 3 * channels + value_dim) * a + (5 * value_dim + 4 * heads) * FP32
        values = 3 if a == FP32 else 4  # a half-precision v is copied to float32 first
        rule = heads * (chunks * chunk * (12 * dk + values * dv + 7 * chunk + 7) + (chunks + 1) * dk * dv) * FP32
        return b * (s * per_token + rule)

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """An estimate of what the selective policy keeps: its matmul outputs (the two input projections, the
        rule's batched products K K^T, Q K^T, W_v, W_k and the outputs, the scan's updates and states) and
        out_proj's output (tensor parallel: this rank's heads', and out_proj's output before and after its
        reduce-scatter)."""
        la, b, s, a, t = cfg.linear_attention, x.batch, x.seq, x.bytes, x.tp
        key_dim, value_dim = (width // t for width in _widths(cfg))
        chunk, heads, dk, dv = la.chunk_size, la.n_heads // t, la.key_head_dim, la.value_head_dim
        padded = -(-s // chunk) * chunk
        projections = s * (2 * key_dim + 2 * value_dim + 2 * heads) * a
        rule = heads * (padded * (2 * chunk + dk + 3 * dv) * FP32 + (padded // chunk + 1) * dk * dv * FP32)
        return b * (projections + rule) + output_projection_bytes(cfg, x)

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        """An estimate: the float32 gradients of the rule's per-chunk tensors alive at once (those of q, k, v, W_v,
        W_k and the C x C products) and of every chunk's state."""
        la, b, s = cfg.linear_attention, x.batch, x.seq
        chunk, heads, dk, dv = la.chunk_size, la.n_heads // x.tp, la.key_head_dim, la.value_head_dim
        padded = -(-s // chunk) * chunk
        return b * heads * (padded * (3 * dk + 3 * dv + 2 * chunk) + (padded // chunk + 1) * dk * dv) * FP32


register(LinearAttention())
