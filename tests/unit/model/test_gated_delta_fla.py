"""The flash-linear-attention backend of the linear_attention blocks (meshformer/model/gated_delta_fla.py) on CPU:
a stand-in `fla` package (in sys.modules) whose `chunk_gated_delta_rule` computes fla's documented contract with
our token-by-token reference: (B, T, H, K) inputs, scale 1/sqrt(K) by default, log decays, post-sigmoid beta,
in-kernel L2 norm, `cu_seqlens` over one flattened row with one initial/final state per sequence. So the argument
mapping (layout, scale, heads, documents -> cu_seqlens, states) is checked for real; the GPU kernel itself is
bench/gated_delta_fla.py's."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.kernel_contract import (
    assert_bench_tells_wrong_from_equal,
    assert_module_equals_torch,
    assert_outputs_and_grads_equal,
    delta_rule_by_sequence,
    install_stand_ins,
)

from meshformer.config.migrate import model_from_flat
from meshformer.errors import ConfigError
from meshformer.model import gated_delta_fla
from meshformer.model.components import component
from meshformer.model.config import LinearAttentionConfig
from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.model.gated_delta_fla import document_starts, fla_gated_delta_rule
from meshformer.model.linear_attention import GatedDeltaNet

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(batch: int, seq: int, k_heads: int = 2, heads: int = 4, dk: int = 8, dv: int = 6
           ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """q, k, v, g (log decays), beta (post-sigmoid) and an initial state, float64."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, seq, k_heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, seq, heads, dv, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(batch, seq, heads, generator=gen, dtype=torch.float64) + 2)
    beta = torch.rand(batch, seq, heads, generator=gen, dtype=torch.float64)
    return (q, k, v, g, beta), torch.randn(batch, heads, dk, dv, generator=gen, dtype=torch.float64)


def documented_rule(calls: list[dict[str, Any]]):
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **rest):
        assert not rest, rest
        assert q.shape == k.shape and q.shape[:3] == v.shape[:3] and g.shape == beta.shape == v.shape[:3]
        calls.append({"cu_seqlens": cu_seqlens, "scale": scale, "l2": use_qk_l2norm_in_kernel})
        return delta_rule_by_sequence(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens)

    return chunk_gated_delta_rule


@pytest.fixture
def fake_fla(monkeypatch) -> list[dict[str, Any]]:
    """Installs the stand-in package; returns the record of its calls."""
    calls: list[dict[str, Any]] = []
    install_stand_ins(monkeypatch, {"fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": documented_rule(calls)}})
    monkeypatch.setattr(gated_delta_fla, "fla_importable", lambda: True)
    return calls


def test_document_starts_cover_every_row_and_document() -> None:
    docs = torch.tensor([[0, 0, 1, 1, 1], [3, 3, 3, 3, 3], [0, 1, 2, 2, 2]])
    cu_seqlens, first, last = document_starts(docs)
    assert cu_seqlens.tolist() == [0, 2, 5, 10, 11, 12, 15]
    assert first.tolist() == [0, 2, 3] and last.tolist() == [1, 2, 5]


@pytest.mark.parametrize("documents", [False, True])
def test_mapping_equals_our_rule(fake_fla, documents: bool) -> None:
    (q, k, v, g, beta), state = inputs(batch=3, seq=13)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, state)]
    docs = torch.tensor([[0] * 5 + [1] * 8, [2] * 13, [0] * 3 + [1] * 4 + [2] * 6]) if documents else None
    ours, ours_final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=state,
                                              output_final_state=True, doc_ids=docs, use_qk_l2norm=True)
    theirs, final = fla_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                         doc_ids=docs, use_qk_l2norm=True)
    assert final is not None and ours_final is not None and final.shape == state.shape
    assert_outputs_and_grads_equal((theirs, final), (ours, ours_final), leaves)
    (call,) = fake_fla
    assert call["l2"] and call["scale"] is None and (call["cu_seqlens"] is not None) == documents


def module(backend: str) -> GatedDeltaNet:
    torch.manual_seed(0)
    cfg = model_from_flat(d_model=24, norm="rmsnorm", bias=False, layer_types=["linear_attention"],
                          linear_attention=LinearAttentionConfig(n_heads=4, n_key_heads=2, key_head_dim=8,
                                                                 value_head_dim=6, chunk_size=4, backend=backend))
    return GatedDeltaNet(cfg).double()


def test_module_on_fla_equals_torch(fake_fla) -> None:
    theirs, ours = module("fla"), module("torch")
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 6:] = False
    assert_module_equals_torch(theirs, ours, padding)
    assert len(fake_fla) == 1


def test_auto_keeps_torch_off_cuda(fake_fla) -> None:
    module("auto")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert fake_fla == []


def test_fla_backend_without_the_package_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(gated_delta_fla, "fla_importable", lambda: False)
    cfg = model_from_flat(d_model=32, layer_types=["linear_attention"],
                          linear_attention=LinearAttentionConfig(backend="fla"))
    with pytest.raises(ConfigError, match=r'pip install "meshformer\[fla\]"') as err:
        component("linear_attention").check(cfg)
    assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)  # an import that fails
    with pytest.raises(ImportError, match=r"meshformer\[fla\]"):
        gated_delta_fla.fla_rule()


def test_bench_reports_equality_and_speed(fake_fla) -> None:
    """bench/gated_delta_fla.py's measurement (the GPU check) on CPU: equal sides pass, a wrong side fails."""
    report = assert_bench_tells_wrong_from_equal("bench/gated_delta_fla.py", "1,2,4,8,20", "fla")
    assert set(report["relative_diffs"]) == {"out", "dq", "dk", "dv", "dg", "dbeta"}
