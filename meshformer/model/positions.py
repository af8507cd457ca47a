"""Position schemes: absolute (sinusoidal, learned) added to embeddings; relative (RoPE, ALiBi, T5) in attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshformer.model.config import ModelConfig
from meshformer.renamed import renamed_attribute

BIASED_POSITIONS = ("alibi", "t5_relative")  # schemes that add a bias to the attention scores


def sinusoidal_table(n_positions: int, dim: int, device: torch.device | None = None) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    position = torch.arange(n_positions, dtype=torch.float64, device=device).unsqueeze(1)
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64, device=device) * (-math.log(10000.0) / dim))
    table = torch.zeros(n_positions, dim, dtype=torch.float64, device=device)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)[:, : dim // 2]
    return table.float()


class SinusoidalPositions(nn.Module):
    table: torch.Tensor  # a buffer

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.max_len, self.dim = max_len, dim
        # Non-persistent: follows .to(device), is never trained and never checkpointed.
        self.register_buffer("table", sinusoidal_table(max_len, dim), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the table where it lives (after a meta-device build)."""
        self.register_buffer("table", sinusoidal_table(self.max_len, self.dim, self.table.device), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_len, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight[positions]


@dataclass(frozen=True)
class RopeScaling:
    """How the rotary frequencies are rescaled for a longer context: Hugging Face's rope_type and its parameters
    (the `rope_*` keys of `ModelConfig`)."""

    method: str = "none"  # none | linear | llama3 | yarn (model.rope.scaling)
    factor: float = 1.0
    original_max_len: int | None = None  # llama3, yarn
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole dimensions

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> RopeScaling:
        return cls(cfg.rope.scaling, cfg.rope.factor, cfg.rope.original_max_seq_len, cfg.rope.low_freq_factor,
                   cfg.rope.high_freq_factor, cfg.rope.beta_fast, cfg.rope.beta_slow, cfg.rope.attention_factor,
                   cfg.rope.truncate)


renamed_attribute(RopeScaling, "kind", "method")  # the name of earlier releases (docs/design.md#words)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling(),
                     device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) in float64, cos/sin multiplier), as transformers'
    `modeling_rope_utils` computes them for rope_type default, linear, llama3 and yarn."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    inv_freq = 1.0 / theta ** exponents
    factor = scaling.factor
    if scaling.method == "linear":
        return inv_freq / factor, 1.0
    if scaling.method == "llama3":
        assert scaling.original_max_len is not None  # config/validate.py requires it
        original = scaling.original_max_len
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by the factor, short ones kept, the band between interpolated smoothly
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = torch.where(wavelen > original / scaling.low_freq_factor, inv_freq / factor, inv_freq)
        medium = (wavelen >= original / scaling.high_freq_factor) & (wavelen <= original / scaling.low_freq_factor)
        return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if scaling.method == "yarn":
        assert scaling.original_max_len is not None
        attention_factor = scaling.attention_factor
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

        def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in the context
            return (head_dim * math.log(scaling.original_max_len / (rotations * 2 * math.pi))  # type: ignore[operator]
                    / (2 * math.log(theta)))

        low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
        if scaling.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64, device=device) - low)
                / (high - low if high != low else 0.001)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide it by the factor)
        return inv_freq / factor * (1 - keep) + inv_freq * keep, attention_factor
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """RoPE with the half-split layout (pairs dimension i with i + d/2), as in GPT-NeoX / HF Llama."""

    cos: torch.Tensor  # buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_len: int, theta: float = 10000.0,
                 scaling: RopeScaling = RopeScaling()) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta, self.scaling = head_dim, max_len, theta, scaling
        self._tables(None)

    def _tables(self, device: torch.device | None) -> None:
        inv_freq, attention_factor = rope_frequencies(self.head_dim, self.theta, self.scaling, device)
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", (angles.cos() * attention_factor).float(), persistent=False)
        self.register_buffer("sin", (angles.sin() * attention_factor).float(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the tables where they live (after a meta-device build)."""
        self._tables(self.cos.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables of shape (T, D) for integer positions (T,), shared by every layer."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x of shape (B, H, T, D) by the angles of `RotaryEmbedding.forward`; tables narrower than D rotate
    the first dimensions only (partial RoPE, rope.partial_factor) and leave the rest as they are."""
    cos, sin = (t.to(x.dtype) for t in cos_sin)
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :rotary], (cos, sin)), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def query_scale(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """Llama 4's per-position query multiplier 1 + beta * ln(1 + floor(p / original_max_seq_len)) (model.mla.
    query_scale_beta), fp32, shaped to broadcast over (B, H, T, D) queries: (1, 1, T, 1) from positions (T,),
    (B, 1, T, 1) from each row's position ids (B, T)."""
    assert cfg.rope.original_max_seq_len is not None  # config validation requires it with the scaling
    blocks = torch.floor(positions.float() / cfg.rope.original_max_seq_len)
    scale = 1 + cfg.mla.query_scale_beta * torch.log(1 + blocks)
    return scale.view(-1, 1, positions.shape[-1], 1)


def alibi_slopes(n_heads: int, device: torch.device | None = None) -> torch.Tensor:
    """Geometric slopes 2^(-8i/n) (Press et al.); non-powers of two interleave the next power's slopes."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        return torch.tensor(power_of_two(n_heads), device=device)
    closest = 2 ** math.floor(math.log2(n_heads))
    extra = power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(power_of_two(closest) + extra, device=device)


def alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bias (H, Tq, Tk) = -slope * |i - j|: symmetric, so it serves causal and bidirectional attention."""
    distance = (q_pos[:, None] - k_pos[None, :]).abs().to(slopes.dtype)
    return -slopes[:, None, None] * distance


def relative_position_bucket(
    relative: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket (int64) for each key-minus-query distance in `relative`.

    Bidirectional: half the buckets for keys before the query (or at it), half for keys after it.
    Causal: only keys before the query count; later ones (masked anyway) share bucket 0. Within a half,
    distances below max_exact = half / 2 get a bucket each; larger ones share log-spaced buckets up to
    max_distance, and everything beyond lands in the last bucket.
    """
    if bidirectional:
        num_buckets //= 2
        base = (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        base = torch.zeros_like(relative)
        distance = (-relative).clamp(min=0)
    max_exact = num_buckets // 2
    # float32 logarithms, as in T5's reference implementation, so that bucket edges agree with trained checkpoints;
    # the clamp keeps log() finite for the small distances that torch.where discards.
    ratio = distance.clamp(min=max_exact).float() / max_exact
    far = max_exact + (torch.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return base + torch.where(distance < max_exact, distance, far)


class RelativePositionBias(nn.Module):
    """T5's learned relative position bias: one scalar per (distance bucket, head), shared by a stack's layers."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, *, bidirectional: bool) -> None:
        super().__init__()
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        self.relative_bias = nn.Embedding(num_buckets, n_heads)

    def forward(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bias (H, Tq, Tk) for integer query positions (Tq,) and key positions (Tk,)."""
        buckets = relative_position_bucket(k_pos[None, :] - q_pos[:, None], bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return self.relative_bias(buckets).permute(2, 0, 1)
