"""A matrix optimizer (Muon, NorMuon) stepped beside a hand-written reference of it: the model's matrices by the
reference, everything else by torch's AdamW, both models equal after the steps (tests/unit/train/test_muon.py,
tests/unit/optim/test_normuon.py).

    names = matrix_names(model, opt)
    step_beside_reference(model, ref, opt, names, lambda name: reference(ref_params[name], ...))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def matrix_names(model: nn.Module, opt: torch.optim.Optimizer) -> set[str]:
    """The names of `model`'s parameters in `opt`'s groups of the matrix update."""
    return {n for n, p in model.named_parameters() for g in opt.param_groups if g["update"] == "muon"
            for q in g["params"] if q is p}


def step_beside_reference(model: nn.Module, ref: nn.Module, opt: torch.optim.Optimizer, names: set[str],
                          reference: Callable[[str], None], steps: int = 2) -> None:
    """`steps` steps of `opt` on `model` and, on `ref` (the same weights), of `reference(name)` for each matrix in
    `names` and AdamW (lr 1e-2, betas (0.9, 0.99), weight decay 0.1 on matrices, 0 on vectors) for the rest, both
    from the same random gradients; then every parameter within 1e-6."""
    ref_params = dict(ref.named_parameters())
    adamw = torch.optim.AdamW([
        {"params": [p for n, p in ref_params.items() if n not in names and p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for n, p in ref_params.items() if n not in names and p.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.99), eps=1e-8, foreach=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        adamw.step()
        with torch.no_grad():
            for name in names:
                reference(name)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name
