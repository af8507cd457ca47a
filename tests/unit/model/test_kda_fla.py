"""The flash-linear-attention backend of the kda blocks (meshformer/model/gated_delta_fla.py: `fla_kda_rule`) on
CPU: a stand-in `fla.ops.kda` whose `chunk_kda` computes fla's documented contract with our token-by-token
reference: (B, T, H, K) inputs with g of the same shape (log decays per key channel, `use_gate_in_kernel` off),
scale 1/sqrt(K) by default, post-sigmoid beta, in-kernel L2 norm, float32 (here: float64) initial states, and
`cu_seqlens` over one flattened row with one initial/final state per sequence. The GPU kernel itself is
bench/kda_fla.py's."""

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
from meshformer.model.config import LinearAttentionConfig
from meshformer.model.gated_delta import chunk_gated_delta_rule
from meshformer.model.gated_delta_fla import fla_kda_rule
from meshformer.model.kda import KimiDeltaAttention

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(batch: int, seq: int, heads: int = 3, dk: int = 8, dv: int = 6
           ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """q, k, v, g (log decays per key channel), beta (post-sigmoid) and an initial state, float64."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, seq, heads, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, seq, heads, dv, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(batch, seq, heads, dk, generator=gen, dtype=torch.float64) + 2)
    beta = torch.rand(batch, seq, heads, generator=gen, dtype=torch.float64)
    return (q, k, v, g, beta), torch.randn(batch, heads, dk, dv, generator=gen, dtype=torch.float64)


def documented_kda(calls: list[dict[str, Any]]):
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, cu_seqlens=None, **rest):
        assert not rest and not use_gate_in_kernel, rest
        assert q.shape == k.shape == g.shape and beta.shape == q.shape[:3] and v.shape[:3] == q.shape[:3]
        assert initial_state is None or initial_state.dtype in (torch.float32, torch.float64)
        calls.append({"cu_seqlens": cu_seqlens, "scale": scale, "l2": use_qk_l2norm_in_kernel})
        if cu_seqlens is not None:
            assert initial_state is None or initial_state.shape[0] == cu_seqlens.numel() - 1
        return delta_rule_by_sequence(q, k, v, g, beta, scale, initial_state, output_final_state,
                                      use_qk_l2norm_in_kernel, cu_seqlens)

    return chunk_kda


@pytest.fixture
def fake_fla(monkeypatch) -> list[dict[str, Any]]:
    """Installs the stand-in package; returns the record of its calls."""
    calls: list[dict[str, Any]] = []
    install_stand_ins(monkeypatch, {"fla.ops.kda": {"chunk_kda": documented_kda(calls)}})
    monkeypatch.setattr(gated_delta_fla, "fla_importable", lambda: True)
    monkeypatch.setattr(gated_delta_fla, "require_cuda", lambda t, backend: None)  # CPU tensors through
    return calls


@pytest.mark.parametrize("documents", [False, True])
def test_kda_mapping_equals_our_rule(fake_fla, documents: bool) -> None:
    (q, k, v, g, beta), state = inputs(batch=3, seq=13)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta, state)]
    docs = torch.tensor([[0] * 5 + [1] * 8, [2] * 13, [0] * 3 + [1] * 4 + [2] * 6]) if documents else None
    ours, ours_final = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=state,
                                              output_final_state=True, doc_ids=docs, use_qk_l2norm=True)
    theirs, final = fla_kda_rule(q, k, v, g, beta, initial_state=state, output_final_state=True, doc_ids=docs,
                                 use_qk_l2norm=True)
    assert final is not None and ours_final is not None and final.shape == state.shape
    assert_outputs_and_grads_equal((theirs, final), (ours, ours_final), leaves)
    (call,) = fake_fla
    assert call["l2"] and call["scale"] is None and (call["cu_seqlens"] is not None) == documents


def test_kda_half_precision_state_enters_as_float32(fake_fla) -> None:
    (q, k, v, g, beta), state = inputs(batch=1, seq=5)
    _, final = fla_kda_rule(*(t.float() for t in (q, k, v, g, beta)), initial_state=state.bfloat16(),
                            output_final_state=True)
    assert final is not None and final.dtype == torch.float32


def module(backend: str) -> KimiDeltaAttention:
    torch.manual_seed(0)
    cfg = model_from_flat(d_model=24, norm="rmsnorm", bias=False, layer_types=["kda"],
                          linear_attention=LinearAttentionConfig(n_heads=3, key_head_dim=8, value_head_dim=6,
                                                                 chunk_size=4, backend=backend))
    return KimiDeltaAttention(cfg).double()


def test_kda_module_on_fla_equals_torch(fake_fla) -> None:
    theirs, ours = module("fla"), module("torch")
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, 6:] = False
    assert_module_equals_torch(theirs, ours, padding)
    assert len(fake_fla) == 1


def test_kda_auto_keeps_torch_off_cuda(fake_fla) -> None:
    module("auto")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert fake_fla == []


def test_kda_off_cuda_or_without_the_package_is_one_line(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="runs its kernels on CUDA, but the model is on cpu") as config_err:
        module("fla")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert "\n" not in config_err.value.one_line()
    monkeypatch.setattr(gated_delta_fla, "require_cuda", lambda t, backend: None)
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # an import that fails
    with pytest.raises(ImportError, match=r"meshformer\[fla\]") as err:
        module("fla")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert "\n" not in str(err.value)


def test_kda_bench_reports_equality_and_speed(fake_fla) -> None:
    """bench/kda_fla.py's measurement (the GPU check) on CPU: equal sides pass, a wrong side fails."""
    report = assert_bench_tells_wrong_from_equal("bench/kda_fla.py", "1,2,8,20", "fla")
    assert set(report["relative_diffs"]) == {"out", "dq", "dk", "dv", "dg", "dbeta"}
