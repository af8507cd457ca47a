"""The mamba-ssm / causal-conv1d backend of the mamba2 blocks (meshformer/model/mamba2_kernels.py) on CPU: stand-in
`mamba_ssm.ops.triton.ssd_combined` and `causal_conv1d` modules whose functions compute the libraries' documented
contracts in torch: `causal_conv1d_fn` (x (B, C, T) channel-last when `seq_idx` is given, weight (C, W), bias, taps
of another sequence left out, optional SiLU) and `mamba_chunk_scan_combined` (x (B, T, H, P), dt before
softplus(dt + dt_bias) and its `dt_limit` clamp, A (H,), B and C (B, T, G, N), the skip D, `initial_states` (B, H, P,
N) entering sequence 0 of each row, `seq_idx` (B, T) int32 restarting the state). The scan runs model/ssd.py's
token-by-token reference; the convolution is written here from the contract. So the argument mapping is checked for
real; the GPU kernels themselves are bench/mamba2_ssm.py's."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.kernel_contract import (
    assert_bench_tells_wrong_from_equal,
    assert_module_equals_torch,
    assert_outputs_and_grads_equal,
    install_stand_ins,
)

from meshformer.config.migrate import model_from_flat
from meshformer.errors import ConfigError
from meshformer.model import mamba2_kernels
from meshformer.model.components import component
from meshformer.model.config import MambaConfig
from meshformer.model.gated_delta import causal_conv1d
from meshformer.model.mamba2 import Mamba2
from meshformer.model.mamba2_kernels import kernel_conv1d, kernel_scan, sequence_index
from meshformer.model.ssd import chunk_ssd, recurrent_ssd

pytestmark = pytest.mark.usefixtures("one_thread")


def documented_conv(calls: list[str]):
    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        assert initial_states is None and not return_final_states and activation in (None, "silu", "swish")
        channels, width = weight.shape
        assert x.dim() == 3 and x.shape[1] == channels and (bias is None or bias.shape == (channels,))
        if seq_idx is not None:
            assert x.stride(1) == 1, "seq_idx needs the channel-last layout"
            assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2])
        calls.append("conv")
        seq = x.shape[2]
        padded = F.pad(x, (width - 1, 0))
        out = torch.zeros_like(x) if bias is None else bias[None, :, None].expand_as(x).clone()
        for w in range(width):  # tap w reads the token width - 1 - w back, if it is of the same sequence
            tap = padded[:, :, w: w + seq] * weight[None, :, w, None]
            if seq_idx is not None:
                back = width - 1 - w
                same = torch.zeros_like(seq_idx, dtype=torch.bool)
                same[:, back:] = seq_idx[:, back:] == seq_idx[:, :seq - back]
                tap = tap * same[:, None].to(x.dtype)
            out = out + tap
        return out if activation is None else F.silu(out)

    return causal_conv1d_fn


def documented_scan(calls: list[str]):
    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                  seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        batch, seq, heads, width = x.shape
        assert z is None and cu_seqlens is None and not return_varlen_states and isinstance(chunk_size, int)
        assert dt.shape == (batch, seq, heads) and A.shape == (heads,) and B.shape == C.shape
        assert B.shape[:2] == (batch, seq) and heads % B.shape[2] == 0
        assert initial_states is None or initial_states.shape == (batch, heads, width, B.shape[3])
        assert seq_idx is None or (seq_idx.dtype == torch.int32 and seq_idx.shape == (batch, seq))
        calls.append("scan")
        if dt_bias is not None:
            dt = dt + dt_bias
        if dt_softplus:
            dt = F.softplus(dt)
        if tuple(dt_limit) != (0.0, float("inf")):
            dt = dt.clamp(*dt_limit)
        y, final = recurrent_ssd(x, dt, A, B, C, initial_state=initial_states, doc_ids=seq_idx)
        if D is not None:
            y = y + x * (D[:, None] if D.dim() == 1 else D)
        return (y, final) if return_final_states else y

    return mamba_chunk_scan_combined


@pytest.fixture
def fake_mamba(monkeypatch) -> list[str]:
    """Installs the stand-in packages (and lets CPU tensors through); returns the record of their calls."""
    calls: list[str] = []
    install_stand_ins(monkeypatch, {
        "causal_conv1d": {"causal_conv1d_fn": documented_conv(calls)},
        "mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": documented_scan(calls)}})
    monkeypatch.setattr(mamba2_kernels, "mamba_importable", lambda: True)
    monkeypatch.setattr(mamba2_kernels, "require_cuda", lambda t, backend: None)
    return calls


DOCS = torch.tensor([[5] * 4 + [6] * 9, [0] * 13, [1] * 2 + [2] * 5 + [3] * 6])


def test_sequence_index_numbers_each_rows_documents_from_zero() -> None:
    assert sequence_index(DOCS).tolist()[2] == [0] * 2 + [1] * 5 + [2] * 6
    assert sequence_index(DOCS).dtype == torch.int32 and sequence_index(DOCS)[:2].max() == 1


@pytest.mark.parametrize("documents", [False, True])
def test_conv_mapping_equals_ours(fake_mamba, documents: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 13, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(10, generator=gen, dtype=torch.float64, requires_grad=True)
    docs = DOCS if documents else None
    ours = F.silu(causal_conv1d(x, weight, bias, doc_ids=docs)[0])
    theirs = kernel_conv1d(x, weight, bias, doc_ids=docs)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-12)
    grad = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(theirs, (x, weight, bias), grad),
                    torch.autograd.grad(ours, (x, weight, bias), grad), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert fake_mamba == ["conv"]


@pytest.mark.parametrize("documents", [False, True])
def test_scan_mapping_equals_ours(fake_mamba, documents: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    batch, seq, heads, width, groups, size = 3, 13, 4, 3, 2, 5
    x = torch.randn(batch, seq, heads, width, generator=gen, dtype=torch.float64)
    dt_raw = torch.randn(batch, seq, heads, generator=gen, dtype=torch.float64)
    B, C = (torch.randn(batch, seq, groups, size, generator=gen, dtype=torch.float64) for _ in range(2))
    A_log, D, dt_bias = (torch.randn(heads, generator=gen, dtype=torch.float64) for _ in range(3))
    state = torch.randn(batch, heads, width, size, generator=gen, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, dt_raw, B, C, A_log, D, dt_bias, state)]
    docs = DOCS if documents else None
    dt = F.softplus(dt_raw + dt_bias).clamp(min=0.3)
    ours, ours_final = chunk_ssd(x, dt, -A_log.exp(), B, C, chunk_size=4, initial_state=state, doc_ids=docs)
    ours = ours + x * D[:, None]
    theirs, final = kernel_scan(x, dt_raw, -A_log.exp(), B, C, chunk_size=4, D=D, dt_bias=dt_bias, dt_floor=0.3,
                                initial_state=state, doc_ids=docs)
    expected = assert_outputs_and_grads_equal((theirs, final), (ours, ours_final), leaves)
    assert fake_mamba == ["scan"] and expected[-1].abs().sum() > 0  # the initial state reaches the output


def module(backend: str) -> Mamba2:
    torch.manual_seed(0)
    cfg = model_from_flat(d_model=24, norm="rmsnorm", bias=False, layer_types=["mamba2"],
                          mamba=MambaConfig(n_heads=4, head_dim=6, state_size=5, n_groups=2, chunk_size=4,
                                            dt_floor=0.05, backend=backend))
    mixer = Mamba2(cfg).double()
    with torch.no_grad():  # away from the init's values, so that a skipped or misplaced D or dt_bias shows
        for p in (mixer.D, mixer.dt_bias, mixer.A_log, mixer.conv1d.bias):
            p.normal_()
    return mixer


def test_module_on_the_kernels_equals_torch(fake_mamba) -> None:
    theirs, ours = module("mamba_ssm"), module("torch")
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False  # left padding, as prompts are
    assert_module_equals_torch(theirs, ours, padding)
    assert fake_mamba == ["conv", "scan"]


def test_ulysses_heads_on_the_kernels_equal_torch(fake_mamba) -> None:
    """Under Ulysses (2 ranks as threads) each rank's run of heads and groups reaches the kernels with its own taps,
    D and dt_bias: its pieces equal the torch block over the whole sequence."""
    from helpers.ulysses_threads import run_ranks

    theirs, ours = module("mamba_ssm"), module("torch")
    x = torch.randn(2, 8, 24, dtype=torch.float64)
    padding = torch.arange(8)[None] >= torch.tensor([[0], [3]])
    with torch.no_grad():
        whole = ours(x, padding=padding, documents=DOCS[:2, :8])

        def work(chunk):  # type: ignore[no-untyped-def]
            at = chunk.positions(4, x.device)
            return theirs(x[:, at], chunk=chunk, padding=padding[:, at], documents=DOCS[:2, :8]), at

        for out, at in run_ranks(2, work):
            torch.testing.assert_close(out, whole[:, at], atol=1e-10, rtol=1e-10)
    assert set(fake_mamba) == {"conv", "scan"}


def test_auto_keeps_torch_off_cuda(fake_mamba) -> None:
    module("auto")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert fake_mamba == []


def test_missing_library_or_device_is_one_line(monkeypatch) -> None:
    monkeypatch.setattr(mamba2_kernels, "mamba_importable", lambda: False)
    cfg = model_from_flat(d_model=32, layer_types=["mamba2"], mamba=MambaConfig(backend="mamba_ssm"))
    with pytest.raises(ConfigError, match=r'pip install "meshformer\[mamba\]"') as err:
        component("mamba2").check(cfg)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="runs its kernels on CUDA, but the model is on cpu") as err:
        module("mamba_ssm")(torch.randn(1, 5, 24, dtype=torch.float64))
    assert "\n" not in err.value.one_line()
    monkeypatch.setattr(mamba2_kernels, "require_cuda", lambda t, backend: None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # an import that fails
    with pytest.raises(ImportError, match=r"meshformer\[mamba\]"):
        module("mamba_ssm")(torch.randn(1, 5, 24, dtype=torch.float64))


def test_bench_reports_equality_and_speed(fake_mamba) -> None:
    """bench/mamba2_ssm.py's measurement (the GPU check) on CPU: equal sides pass, a wrong side fails."""
    report = assert_bench_tells_wrong_from_equal("bench/mamba2_ssm.py", "1,4,8,2,8,20", "kernels")
    assert set(report["relative_diffs"]) == {"out", "dxbc", "dconv", "ddt", "dA_log", "dD", "ddt_bias"}
