"""Mamba-2's scan and convolution through mamba-ssm's and causal-conv1d's CUDA/Triton kernels
(`mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`, `causal_conv1d.causal_conv1d_fn`), the optional GPU
backend of the mamba2 blocks (`model.mamba.backend`; the extra `meshformer[mamba]`).

They take what model/mamba2.py gives model/ssd.py's `chunk_ssd` and model/gated_delta.py's `causal_conv1d` and return
the same results. The convolution reads (B, channels, T): the (B, T, channels) activations transposed, which is the
channel-last layout the library requires for `seq_idx`. The scan reads the same (B, T, H, P) / (B, T, G, N) layout as
ours; it is given dt before its softplus with `dt_bias`, `dt_softplus` and `dt_limit` (the floor), and the skip D, so
those are computed in the kernel. Packed documents become `seq_idx` (B, T), each row's documents numbered from 0:
the state and the convolution window restart where it changes, and an initial state belongs to sequence 0, each
row's first document, as ours does.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from meshformer.model.gated_delta_fla import require_cuda

MAMBA_EXTRA = 'model.mamba.backend = "mamba_ssm" needs mamba-ssm and causal-conv1d: pip install "meshformer[mamba]"'

_KERNELS = {"scan": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
            "conv": ("causal_conv1d", "causal_conv1d_fn")}


def mamba_importable() -> bool:
    """Whether mamba-ssm and causal-conv1d are installed (neither is imported here)."""
    return all(importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d"))


def mamba_kernel(which: str) -> Callable[..., Any]:
    """The library function for "scan" or "conv"; ImportError in one line naming the extra where it is missing."""
    module_name, name = _KERNELS[which]
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"{MAMBA_EXTRA} ({err})") from err
    kernel: Callable[..., Any] = getattr(module, name)
    return kernel


def sequence_index(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids, non-decreasing per row -> the libraries' `seq_idx`: int32, each row's documents 0, 1, ..."""
    changes = torch.zeros_like(doc_ids, dtype=torch.int32)
    changes[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int32)
    return changes.cumsum(1, dtype=torch.int32)


def kernel_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                  doc_ids: torch.Tensor | None = None, silu: bool = True) -> torch.Tensor:
    """model/gated_delta.py's `causal_conv1d` (x (B, T, C), weight (C, W), no carried state) by causal-conv1d, with
    the SiLU after it fused. Returns (B, T, C)."""
    require_cuda(x, 'model.mamba.backend = "mamba_ssm"')
    conv = mamba_kernel("conv")
    seq_idx = None if doc_ids is None else sequence_index(doc_ids)
    out = conv(x.transpose(1, 2), weight, bias, seq_idx=seq_idx, activation="silu" if silu else None)
    return out.transpose(1, 2)


def kernel_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                chunk_size: int, D: torch.Tensor, dt_bias: torch.Tensor, dt_floor: float,
                initial_state: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan with the skip: y + D x, as model/mamba2.py computes it with `chunk_ssd`, from x (B, T, H, P), dt
    (B, T, H) before dt_bias and its softplus, A (H,), B and C (B, T, G, N). Returns y (B, T, H, P) and the final
    state (B, H, P, N)."""
    require_cuda(x, 'model.mamba.backend = "mamba_ssm"')
    scan = mamba_kernel("scan")
    seq_idx = None if doc_ids is None else sequence_index(doc_ids)
    y, final = scan(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, initial_states=initial_state, seq_idx=seq_idx,
                    dt_softplus=True, dt_limit=(dt_floor, float("inf")), return_final_states=True)
    return y, final
