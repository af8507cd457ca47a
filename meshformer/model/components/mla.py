"""Multi-head latent attention (`model/mla.py`, DeepSeek-V2/V3) as the token-mixer kind `mla`, reading `[model.mla]`
for its widths and `[model.attention]` for its head count, backend, dropout and score scale.

Each token writes one latent of kv_lora_rank and one rotary key of qk_rope_head_dim shared by every head; the
heads' keys and values are expanded from the latent. Tensor parallel splits the expansions (q_b_proj or q_proj,
kv_b_proj) and o_proj by heads and keeps the down-projections and latent norms whole on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import nn

from meshformer.errors import ConfigError
from meshformer.model.components import register
from meshformer.model.components.attention import (
    attention_calls,
    keys_kept,
    sdpa_mask,
    ulysses_heads,
    uses_math_attention,
)
from meshformer.model.components.base import (
    FP32,
    ActivationLayout,
    GenerationCache,
    InitFn,
    TokenMixer,
    output_projection_bytes,
)
from meshformer.model.config import ModelConfig
from meshformer.model.tp_styles import COLWISE, GATHER_MASKED, PARTIAL_GRADIENT, ROWWISE


def mla_matmuls(cfg: ModelConfig) -> tuple[int, int]:
    """Matmul weights (no biases) read per query (the query path and o_proj) and per key (the latent and rotary
    key's down-projection, the keys' and values' expansion: each token's latent is expanded once)."""
    m, d, heads = cfg.mla, cfg.d_model, cfg.attention.n_heads
    q = d * heads * m.qk_head_dim if m.q_lora_rank is None else (d + heads * m.qk_head_dim) * m.q_lora_rank
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return q + heads * m.v_head_dim * d, kv


class LatentAttention(TokenMixer):
    """Causal self-attention through a compressed key/value latent; its cache holds the latent and rotary key."""

    name = "mla"
    exports = frozenset({"mla.q_lora_rank", "mla.kv_lora_rank", "mla.qk_nope_head_dim", "mla.qk_rope_head_dim",
                         "mla.v_head_dim", "mla.rope_interleave", "mla.mscale_all_dim"})
    section = "mla"
    blockwise_kernel = False  # SDPA or the math path (model/mla.py)
    # MuonClip: per head, the position-free query and key rows by sqrt(gamma), the rotary query rows by gamma, the
    # shared rotary key untouched (MultiHeadLatentAttention.qk_clip_rows)
    qk_clip = True
    # what config validation refuses alongside mla blocks: options of [model.attention] these blocks never compute
    # the kinds that may share its one rotary table under RoPE (itself; DSA: its shared-selection variant)
    rotary_peers: ClassVar[frozenset[str]] = frozenset({"mla"})
    UNUSED: ClassVar[tuple[str, ...]] = ("n_kv_heads", "head_dim", "qk_norm", "sinks", "softcap", "output_gate",
                                         "qkv_bias")

    def ulysses(self, cfg: ModelConfig, cp: int, tp: int) -> str | None:
        # the latent is expanded to per-head keys and values on each rank before the all-to-all: every head its own
        return ulysses_heads(cfg.attention.n_heads, cfg.attention.n_heads, cp, tp)

    def build(self, cfg: ModelConfig, *, causal: bool) -> nn.Module:
        from meshformer.model.mla import MultiHeadLatentAttention

        return MultiHeadLatentAttention(cfg)

    def check(self, cfg: ModelConfig) -> None:
        from meshformer.model.families import get_family_spec  # the families' formulas import this package

        name = self.name
        # one rotary table per model: its width is qk_rope_head_dim (without RoPE, as Kimi Linear, any neighbours)
        if cfg.position == "rope" and not set(cfg.layer_types) <= self.rotary_peers:
            raise ConfigError(f"model.layer_types={cfg.layer_types} mixes {name} with other token mixers under RoPE",
                              f'use layer_types = ["{name}"] (every block), or no {name}, or model.position = "none"')
        if any(not stack.causal or stack.cross for stack in get_family_spec(cfg.family).stacks) \
                or cfg.position not in ("rope", "none"):
            raise ConfigError(f"{name} blocks are causal self-attention with RoPE or no positions, but model.family="
                              f"{cfg.family!r}, model.position={cfg.position!r}",
                              "use family='decoder' and position='rope' (or 'none')")
        x = cfg.mla
        widths = {"kv_lora_rank": x.kv_lora_rank, "qk_nope_head_dim": x.qk_nope_head_dim,
                  "qk_rope_head_dim": x.qk_rope_head_dim, "v_head_dim": x.v_head_dim,
                  "q_lora_rank": 1 if x.q_lora_rank is None else x.q_lora_rank}
        if bad := [k for k, v in widths.items() if v <= 0]:
            raise ConfigError(f"model.mla.{bad[0]}={widths[bad[0]]} must be positive",
                              "DeepSeek-V3: kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, "
                              "v_head_dim=128")
        # a latent or a head computed from the d_model-wide residual stream spans at most d_model directions: any
        # width beyond it adds weights (and memory) without adding anything the model can compute
        ranks = {"q_lora_rank": x.q_lora_rank or 0, "kv_lora_rank": x.kv_lora_rank,
                 "qk_nope_head_dim + qk_rope_head_dim": x.qk_head_dim, "v_head_dim": x.v_head_dim}
        if wide := [k for k, v in ranks.items() if v > cfg.d_model]:
            raise ConfigError(f"model.mla.{wide[0]}={ranks[wide[0]]} is wider than model.d_model={cfg.d_model}",
                              "a latent or head computed from the d_model-wide residual stream holds at most d_model "
                              "independent directions; keep each MLA rank and per-head width <= d_model (DeepSeek-V3: "
                              "q_lora_rank=1536, kv_lora_rank=512, 128 + 64 query/key and 128 value columns per "
                              "head at d_model=7168)")
        if x.qk_rope_head_dim % 2:
            raise ConfigError(f"model.mla.qk_rope_head_dim={x.qk_rope_head_dim} must be even (RoPE rotates pairs)",
                              "use e.g. 64")
        a = cfg.attention
        set_values = {"n_kv_heads": a.n_kv_heads not in (None, a.n_heads), "head_dim": a.head_dim,
                      "qk_norm": a.qk_norm, "sinks": a.sinks, "softcap": a.softcap, "output_gate": a.output_gate,
                      "qkv_bias": a.qkv_bias is not None and a.qkv_bias != cfg.bias}
        if set_keys := [f"model.attention.{k}" for k in self.UNUSED if set_values[k]]:
            raise ConfigError(f"{set_keys[0]} is set, but {name} blocks do not use it (their heads are model.attention."
                              "n_heads, their widths model.mla.*, their biases model.bias)",
                              f"drop {set_keys[0]} or use full_attention blocks")
        if x.query_scale_beta and (name != "mla" or cfg.position != "rope" or cfg.rope.original_max_seq_len is None):
            raise ConfigError(f"model.mla.query_scale_beta={x.query_scale_beta} scales queries by their position past "
                              f"model.rope.original_max_seq_len, which {name} blocks with model.position="
                              f"{cfg.position!r} and original_max_seq_len={cfg.rope.original_max_seq_len} lack",
                              "use mla blocks with RoPE and set model.rope.original_max_seq_len, or drop "
                              "query_scale_beta")
        if cfg.rope.partial_factor != 1:  # mla rotates its own qk_rope_head_dim columns of each head
            raise ConfigError(f"model.rope.partial_factor={cfg.rope.partial_factor} is set, but {name} blocks rotate "
                              "model.mla.qk_rope_head_dim columns of each head",
                              "drop model.rope.partial_factor and set model.mla.qk_rope_head_dim")

    def rotary_width(self, cfg: ModelConfig) -> int:
        return cfg.mla.qk_rope_head_dim

    def tp_rules(self, cfg: ModelConfig) -> Mapping[str, str]:
        # Whole heads per rank: the latent's and the queries' gradients are summed by the split up-projections'
        # backward; the rotary key reaches every head directly, so its gradient is summed where it enters.
        return {"": GATHER_MASKED, "q_proj": COLWISE, "q_b_proj": COLWISE, "kv_b_proj": COLWISE, "o_proj": ROWWISE,
                "shared_key": PARTIAL_GRADIENT}

    def tp_divides(self, cfg: ModelConfig) -> list[tuple[str, int, str]]:
        return [("model.attention.n_heads", cfg.attention.n_heads, "attention heads are split across tensor-parallel "
                 "ranks")]

    def init_rule(self, cfg: ModelConfig, name: str) -> InitFn | None:
        if name in ("q_a_norm.weight", "kv_a_norm.weight"):  # plain RMSNorms: norm.weight_offset is not theirs
            return lambda t, g: t.fill_(1.0)
        return None

    def new_cache(self) -> GenerationCache | None:
        from meshformer.model.attention import KVCache

        return KVCache()  # k: the latents (B, 1, T, kv_lora_rank), v: the rotated shared keys (B, 1, T, rope width)

    def cache_per_token(self, cfg: ModelConfig) -> int:
        return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim

    # ---------------------------------------------------------------- parameters and FLOPs

    def params(self, cfg: ModelConfig) -> int:
        """The matmul weights, the latent norms, and (model.bias) biases on the down-projections and the output."""
        m = cfg.mla
        norms = m.kv_lora_rank + (m.q_lora_rank or 0)
        biases = (m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 0) + cfg.d_model) if cfg.bias else 0
        return sum(mla_matmuls(cfg)) + norms + biases

    def flops(self, cfg: ModelConfig, queries: int, keys: int, *, causal: bool) -> int:
        """The query path and output over the queries, the latent's projection and expansion over the keys, and
        QK^T (qk head width) and AV (v_head_dim) over every key (causal not halved, as for `full_attention`)."""
        per_query, per_key = mla_matmuls(cfg)
        widths = cfg.attention.n_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
        return 2 * queries * per_query + 2 * keys * per_key + 2 * queries * keys * widths

    # ---------------------------------------------------------------- activations (planner/activations.py)

    def _rows(self, cfg: ModelConfig, x: ActivationLayout) -> tuple[int, int, list[tuple[int, int]]]:
        """(this rank's heads, key rows the expanded keys and values hold, the attention calls)."""
        calls = attention_calls(x, False, 0)
        return cfg.attention.n_heads // x.tp, keys_kept(x, calls), calls

    def _latents(self, cfg: ModelConfig, x: ActivationLayout, keys: int) -> float:
        """The down-projections' outputs and the latent norms' outputs (whole on every tensor-parallel rank): the
        query latent over the queries, the key/value latent and rotary key over the (gathered) keys."""
        m, b, a = cfg.mla, x.batch, x.bytes
        query = 2 * b * x.seq * m.q_lora_rank * a if m.q_lora_rank is not None else 0.0
        return query + b * x.seq * (m.kv_lora_rank + m.qk_rope_head_dim) * a + b * keys * m.kv_lora_rank * a

    def saved_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        """The (gathered) normalised input; the latents; q and the expanded keys and values (per head: qk, qk and
        v wide), the output and SDPA's fp32 log-sum-exp and mask, or the math path's softmax."""
        m, b, s, a = cfg, x.batch, x.seq, x.bytes
        heads, keys, calls = self._rows(cfg, x)
        qk, v = m.mla.qk_head_dim, m.mla.v_head_dim
        total: float = b * s * m.d_model * a + self._latents(cfg, x, keys)
        total += b * heads * (s * (qk + v) + keys * (qk + v)) * a
        if uses_math_attention(m):
            scores = b * heads * sum(q * k for q, k in calls)
            total += scores * FP32 + (scores * a if a != FP32 else 0)
            if m.attention.dropout > 0:
                total += scores * (a + 1)
        else:
            total += b * heads * s * FP32 + sdpa_mask(x, calls, False)
        return total

    def selective_bytes(self, cfg: ModelConfig, x: ActivationLayout, *, memory_len: int, causal: bool) -> float:
        m, b, s, a = cfg, x.batch, x.seq, x.bytes
        heads, keys, calls = self._rows(cfg, x)
        qk, v, nope = m.mla.qk_head_dim, m.mla.v_head_dim, m.mla.qk_nope_head_dim
        total: float = self._latents(cfg, x, keys)
        total += b * heads * (s * (qk + v) + keys * (nope + v)) * a  # q, attention output, kv_b_proj's output
        total += b * heads * s * FP32 + sdpa_mask(x, calls, False)
        if uses_math_attention(m):
            total += 2 * b * heads * sum(q * k for q, k in calls) * a
        return total + output_projection_bytes(m, x)

    def backward_bytes(self, cfg: ModelConfig, x: ActivationLayout, freed: float) -> float:
        m, b, s, a = cfg, x.batch, x.seq, x.bytes
        heads, _, calls = self._rows(cfg, x)
        keys = max(k for _, k in calls)  # under context parallel: the gathered sequence's key/value gradients
        total: float = b * heads * (s + keys) * (m.mla.qk_head_dim + m.mla.v_head_dim) * a
        if m.attention.backend == "math":
            total += 2 * b * heads * sum(q * k for q, k in calls) * FP32
        return total


register(LatentAttention())
