"""Our chunked KDA rule (model/gated_delta.py with a decay per key channel) against flash-linear-attention's
`chunk_kda` through model/gated_delta_fla.py (kda blocks with linear_attention.backend = "fla"), forward + backward
on one GPU.

Per shape (B, H, D, T; Dk = Dv = D, Kimi-Linear-48B-A3B's 32 heads of width 128 by default; L2-norm of q/k inside
the rule, as the blocks call it): the same inputs to both sides, rounds alternating between them after
a warm-up round, the median time per side and the ratio ours / fla (> 1: fla faster). Equality: the largest
difference of the outputs and of every input's gradient, each relative to the largest magnitude of ours, must be
within --tolerance (default 2e-2 in bf16: fla keeps bf16 intermediates where ours computes in fp32; 2e-3 in fp32,
where Triton's dots may run TF32). One JSON line per shape; where fla or CUDA is missing, one line saying so.

    python bench/kda_fla.py [--shape B,H,D,T ...] [--dtype bf16] [--rounds 5] [--tolerance X]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import gpu_comparison, gpu_main, run_sides

from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.model.gated_delta_fla import fla_importable, fla_kda_rule

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOLERANCE = {"bf16": 2e-2, "fp32": 2e-3}
SHAPES = ["1,32,128,2048", "1,32,128,8192"]  # B,H,D,T


def _inputs(batch: int, heads: int, dim: int, seq: int, dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) + shift).to(device, dtype).requires_grad_()

    q, k, v = (leaf(batch, seq, heads, dim) for _ in range(3))
    g = F.logsigmoid(torch.randn(batch, seq, heads, dim, generator=gen) + 3).to(device, dtype).requires_grad_()
    beta = torch.rand(batch, seq, heads, generator=gen).to(device, dtype).requires_grad_()
    grad = torch.randn(batch, seq, heads, dim, generator=gen).to(device, dtype)
    return (q, k, v, g, beta), grad


def _sides() -> dict[str, Callable[..., torch.Tensor]]:
    return {"ours": lambda *x: chunk_gated_delta_rule(*x, chunk_size=64, use_qk_l2norm=True)[0],
            "fla": lambda *x: fla_kda_rule(*x, use_qk_l2norm=True)[0]}


def measure(shape: str, dtype: str, rounds: int, tolerance: float, device: str) -> dict:
    batch, heads, dim, seq = (int(s) for s in shape.split(","))
    inputs, grad = _inputs(batch, heads, dim, seq, DTYPES[dtype], device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    medians, results = run_sides(_sides(), inputs, grad, rounds, sync=sync)
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    return {"bench": "kda_fla", "batch": batch, "heads": heads, "head_dim": dim,
            "seq": seq, "dtype": dtype, "rounds": rounds,
            **gpu_comparison(medians, results, "fla", names, tolerance, device)}


def main() -> None:
    gpu_main(__doc__, "kda_fla", SHAPES, "B,H,D,T", TOLERANCE, lambda: None if fla_importable() else
             "flash-linear-attention is not installed (pip install 'meshformer[fla]')", measure)


if __name__ == "__main__":
    main()
