"""Our Mamba-2 convolution and chunked scan (model/gated_delta.py's causal_conv1d, model/ssd.py's chunk_ssd) against
causal-conv1d's and mamba-ssm's kernels through model/mamba2_kernels.py (mamba.backend = "mamba_ssm"), forward +
backward on one GPU.

Per shape (B, H, P, G, N, T; Nemotron-H-8B's 128 heads of width 64, 8 groups, state 128 by default; chunk 128,
convolution width 4, dt floor 1e-3): the same inputs to both sides (the convolution's input x|B|C, its taps, dt before
its softplus, A_log, D, dt_bias), rounds alternating between them after a warm-up round, the median time per side and
the ratio ours / kernels (> 1: the kernels faster). Equality: the largest difference of the output and of every
input's gradient, each relative to the largest magnitude of ours, must be within --tolerance (default 2e-2 in bf16,
2e-3 in fp32). One JSON line per shape; where the libraries or CUDA are missing, one line saying so.

    python bench/mamba2_ssm.py [--shape B,H,P,G,N,T ...] [--dtype bf16] [--rounds 5] [--tolerance X]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import gpu_comparison, gpu_main, run_sides

from meshformer.model.gated_delta import causal_conv1d
from meshformer.model.mamba2_kernels import kernel_conv1d, kernel_scan, mamba_importable
from meshformer.model.ssd import chunk_ssd

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"bf16": 2e-2, "fp32": 2e-3}
SHAPES = ["1,128,64,8,128,2048", "1,128,64,8,128,8192"]  # B,H,P,G,N,T
CHUNK, WIDTH, DT_FLOOR = 128, 4, 1e-3
NAMES = ["out", "dxbc", "dconv", "ddt", "dA_log", "dD", "ddt_bias"]


def _inputs(batch: int, heads: int, width: int, groups: int, size: int, seq: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    channels = heads * width + 2 * groups * size

    def leaf(*shape: int, scale: float = 1.0, dtype: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    xbc, taps = leaf(batch, seq, channels), leaf(channels, WIDTH, scale=0.5)
    dt = leaf(batch, seq, heads)
    # A_log, D and dt_bias stay float32, as the parameters are under mixed precision
    params = [leaf(heads, scale=0.5, dtype=torch.float32) for _ in range(3)]
    grad = torch.randn(batch, seq, heads, width, generator=gen).to(device, dtype)
    return (xbc, taps, dt, *params), grad, (heads, width, groups, size)


def _split(xbc: torch.Tensor, dims: tuple[int, int, int, int]) -> tuple[torch.Tensor, ...]:
    heads, width, groups, size = dims
    xs, B, C = xbc.split([heads * width, groups * size, groups * size], dim=-1)
    return xs.unflatten(-1, (heads, width)), B.unflatten(-1, (groups, size)), C.unflatten(-1, (groups, size))


def _ours(dims, xbc, taps, dt, A_log, D, dt_bias) -> torch.Tensor:  # type: ignore[no-untyped-def]
    xs, B, C = _split(F.silu(causal_conv1d(xbc, taps)[0]), dims)
    step = F.softplus(dt.float() + dt_bias).clamp(min=DT_FLOOR)
    y, _ = chunk_ssd(xs, step, -A_log.exp(), B, C, chunk_size=CHUNK)
    return y + xs * D.to(xs.dtype)[:, None]


def _kernels(dims, xbc, taps, dt, A_log, D, dt_bias) -> torch.Tensor:  # type: ignore[no-untyped-def]
    xs, B, C = _split(kernel_conv1d(xbc, taps, None), dims)
    return kernel_scan(xs, dt, -A_log.exp(), B, C, chunk_size=CHUNK, D=D, dt_bias=dt_bias, dt_floor=DT_FLOOR)[0]


def _sides() -> dict[str, Callable[..., torch.Tensor]]:
    return {"ours": _ours, "kernels": _kernels}


def measure(shape: str, dtype: str, rounds: int, tolerance: float, device: str) -> dict:
    batch, heads, width, groups, size, seq = (int(s) for s in shape.split(","))
    inputs, grad, dims = _inputs(batch, heads, width, groups, size, seq, DTYPES[dtype], device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sides = {name: partial(fn, dims) for name, fn in _sides().items()}
    medians, results = run_sides(sides, inputs, grad, rounds, sync=sync)
    return {"bench": "mamba2_ssm", "batch": batch, "heads": heads, "head_dim": width, "groups": groups,
            "state_size": size, "seq": seq, "dtype": dtype, "rounds": rounds,
            **gpu_comparison(medians, results, "kernels", NAMES, tolerance, device)}


def main() -> None:
    gpu_main(__doc__, "mamba2_ssm", SHAPES, "B,H,P,G,N,T", TOLERANCE, lambda: None if mamba_importable() else
             "mamba-ssm / causal-conv1d are not installed (pip install 'meshformer[mamba]')", measure)


if __name__ == "__main__":
    main()
