"""Position schemes: absolute (sinusoidal, learned) added to embeddings; relative (RoPE, ALiBi, T5) in attention."""

from __future__ import annotations

import math

import torch
from torch import nn

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


class RotaryEmbedding(nn.Module):
    """RoPE with the half-split layout (pairs dimension i with i + d/2), as in GPT-NeoX / HF Llama."""

    cos: torch.Tensor  # buffers
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta = head_dim, max_len, theta
        self._tables(None)

    def _tables(self, device: torch.device | None) -> None:
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device)
                                        / self.head_dim)
        angles = torch.outer(torch.arange(self.max_len, dtype=torch.float64, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the tables where they live (after a meta-device build)."""
        self._tables(self.cos.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables of shape (T, D) for integer positions (T,), shared by every layer."""
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x of shape (B, H, T, D) by the angles of `RotaryEmbedding.forward`."""
    cos, sin = (t.to(x.dtype) for t in cos_sin)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
