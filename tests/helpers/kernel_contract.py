"""A GPU-kernel backend checked on CPU against the library's documented contract (test_gated_delta_fla,
test_kda_fla, test_mamba2_kernels): stand-in modules in sys.modules computing the contract in torch, then the
backend's outputs and gradients against our torch path.

    install_stand_ins(monkeypatch, {"fla.ops.kda": {"chunk_kda": fake}})
    assert_outputs_and_grads_equal((theirs, final), (ours, ours_final), leaves)
    assert_module_equals_torch(module("fla"), module("torch"), padding)
    assert_bench_tells_wrong_from_equal("bench/kda_fla.py", "1,2,8,20", "fla")
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from helpers.common import load_script
from meshformer.model.gated_delta import recurrent_gated_delta_rule


def install_stand_ins(monkeypatch: pytest.MonkeyPatch, modules: dict[str, dict[str, Callable[..., Any]]]) -> None:
    """Each dotted name in `modules` (and every package above it) as a module holding the given functions."""
    for dotted, functions in modules.items():
        parts = dotted.split(".")
        for n in range(1, len(parts)):
            monkeypatch.setitem(sys.modules, ".".join(parts[:n]), types.ModuleType(".".join(parts[:n])))
        module = types.ModuleType(dotted)
        for name, fn in functions.items():
            setattr(module, name, fn)
        monkeypatch.setitem(sys.modules, dotted, module)


def delta_rule_by_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None, initial_state: torch.Tensor | None, output_final_state: bool,
                           use_qk_l2norm: bool, cu_seqlens: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's chunked delta rules as documented, through our token-by-token reference: without `cu_seqlens` one
    sequence per row; with it one flattened row of sequences, each with its own initial and final state."""
    if cu_seqlens is None:
        return recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)
    assert q.shape[0] == 1, "variable-length inputs are one row"
    outs, finals = [], []
    for n, (start, end) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        piece = [x[:, start:end] for x in (q, k, v, g, beta)]
        state = None if initial_state is None else initial_state[n:n + 1]
        out, final = recurrent_gated_delta_rule(*piece, scale=scale, initial_state=state, output_final_state=True,
                                                use_qk_l2norm=use_qk_l2norm)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)


def assert_outputs_and_grads_equal(theirs: tuple[torch.Tensor, torch.Tensor], ours: tuple[torch.Tensor, torch.Tensor],
                                   leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Outputs and final states within 1e-10, and so the gradients of both into every leaf. Returns ours."""
    (out, final), (ours_out, ours_final) = theirs, ours
    torch.testing.assert_close(out, ours_out, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, ours_final, rtol=0, atol=1e-10)
    weights = torch.randn_like(ours_out)
    expected = torch.autograd.grad((ours_out * weights).sum() + ours_final.sum(), leaves)
    got = torch.autograd.grad((out * weights).sum() + final.sum(), leaves)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    return expected


def assert_module_equals_torch(theirs: nn.Module, ours: nn.Module, padding: torch.Tensor) -> None:
    """Two blocks of the same weights, one on the kernel backend: the same outputs and parameter gradients on a
    padded float64 batch (2 rows of 9 tokens, width 24) whose first row holds two documents."""
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    docs = torch.tensor([[0] * 4 + [1] * 5, [0] * 9])
    outs = []
    for mixer in (theirs, ours):
        out = mixer(x, padding=padding, documents=docs)
        out.square().sum().backward()
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-10)
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=name)


def assert_bench_tells_wrong_from_equal(script: str, shape: str, other: str) -> dict:
    """The bench's measurement (the GPU check) on CPU: equal sides pass, a side 1% off fails. Returns the passing
    report."""
    bench = load_script(script)
    report = bench.measure(shape, "fp32", rounds=1, tolerance=1e-5, device="cpu")
    assert report["equal"]
    assert report["ours_ms"] > 0 and report[f"{other}_ms"] > 0
    sides = bench._sides()
    bench._sides = lambda: {**sides, other: lambda *x: 1.01 * sides[other](*x)}
    assert not bench.measure(shape, "fp32", rounds=1, tolerance=1e-5, device="cpu")["equal"]
    return report
