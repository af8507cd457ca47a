"""The gated delta rule (meshformer/model/gated_delta.py), with a decay per head (Gated DeltaNet) and per key channel
(KDA): the chunked form against the token-by-token reference (float64: outputs, final states, gradients), packed
documents against each document run alone, decoding step by step against the chunked whole, and `transformers`'
Qwen3-Next and Kimi Linear fallbacks (fp32) on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshformer.model.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    doc_ids_from_cu_seqlens,
    l2norm,
    recurrent_gated_delta_rule,
)


def inputs(batch=2, seq=37, k_heads=2, heads=4, dk=8, dv=6, dtype=torch.float64, seed=0, per_channel=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, seq, k_heads, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(batch, seq, heads, dv, generator=gen, dtype=dtype)
    decays = (batch, seq, heads, dk) if per_channel else (batch, seq, heads)
    g = F.logsigmoid(torch.randn(decays, generator=gen, dtype=dtype) + 2)  # decays ~0.6-0.99
    beta = torch.rand(batch, seq, heads, generator=gen, dtype=dtype)
    state = torch.randn(batch, heads, dk, dv, generator=gen, dtype=dtype)
    return (q, k, v, g, beta), state


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("l2", [False, True])
def test_chunked_equals_recurrent_float64(chunk_size, l2, per_channel):
    x, state = inputs(per_channel=per_channel)  # T = 37: never a multiple of the chunk (but for 1)
    ref, ref_state = recurrent_gated_delta_rule(*x, initial_state=state, output_final_state=True, use_qk_l2norm=l2)
    out, final = chunk_gated_delta_rule(*x, chunk_size=chunk_size, initial_state=state, output_final_state=True,
                                        use_qk_l2norm=l2)
    assert out.shape == (2, 37, 4, 6) and out.dtype == torch.float64 and final is not None
    # rtol: without the L2 norm the random keys grow the state to ~1e6, where 1e-10 is an ulp
    torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-10)
    torch.testing.assert_close(final, ref_state, rtol=1e-14, atol=1e-10)
    assert chunk_gated_delta_rule(*x, chunk_size=chunk_size)[1] is None  # only when asked


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("use_final", [False, True])
def test_chunked_gradients_equal_recurrent_float64(documents, use_final, per_channel):
    x, state = inputs(seq=21, per_channel=per_channel)
    doc_ids = torch.tensor([[0] * 6 + [1] * 9 + [2] * 6, [0] * 21]) if documents else None

    def grads(fn, **kw):
        leaves = [t.clone().requires_grad_() for t in (*x, state)]
        out, final = fn(*leaves[:5], initial_state=leaves[5], output_final_state=use_final, doc_ids=doc_ids,
                        use_qk_l2norm=True, **kw)
        gen = torch.Generator().manual_seed(1)
        loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
        if final is not None:  # otherwise the scan's backward gets no gradient for the final state
            loss = loss + (final**2).sum()
        return torch.autograd.grad(loss, leaves)

    ref = grads(recurrent_gated_delta_rule)
    for chunk_size in (4, 8) if not per_channel else (4, 12):  # 12: blocks of 12 and 6 channel pairs across blocks
        for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], grads(chunk_gated_delta_rule,
                              chunk_size=chunk_size), ref, strict=True):
            assert b.abs().max() > 0, name
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"d{name}, chunk {chunk_size}")


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_packed_documents_equal_each_alone(chunk_size, per_channel):
    lengths = [[4, 1, 10, 7], [11, 11]]  # a one-token document, boundaries at a chunk edge (4) and inside chunks
    x, state = inputs(seq=22, per_channel=per_channel)
    doc_ids = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        kw = {"chunk_size": chunk_size} if fn is chunk_gated_delta_rule else {}
        out, final = fn(*x, initial_state=state, output_final_state=True, doc_ids=doc_ids, use_qk_l2norm=True, **kw)
        for row, row_lengths in enumerate(lengths):
            start = 0
            for i, n in enumerate(row_lengths):
                piece = [t[row:row + 1, start:start + n] for t in x]
                init = state[row:row + 1] if i == 0 else None  # the initial state is the first document's
                alone, alone_final = fn(*piece, initial_state=init, output_final_state=True, use_qk_l2norm=True,
                                        **kw)
                torch.testing.assert_close(out[row:row + 1, start:start + n], alone, rtol=0, atol=1e-10)
                start += n
            torch.testing.assert_close(final[row:row + 1], alone_final, rtol=0, atol=1e-10)  # the last document's
    assert torch.equal(doc_ids_from_cu_seqlens(torch.tensor([0, 4, 5, 15, 22])), doc_ids[:1])


def test_packed_conv_equals_each_alone():
    gen = torch.Generator().manual_seed(0)
    lengths, channels, width = [2, 6, 1, 5], 3, 4
    x = torch.randn(1, sum(lengths), channels, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(channels, generator=gen, dtype=torch.float64)
    state = torch.randn(1, width - 1, channels, generator=gen, dtype=torch.float64)
    doc_ids = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]])
    out, next_state = causal_conv1d(x, weight, bias, state=state, doc_ids=doc_ids)
    start = 0
    for i, n in enumerate(lengths):
        alone, alone_state = causal_conv1d(x[:, start:start + n], weight, bias, state=state if i == 0 else None)
        torch.testing.assert_close(out[:, start:start + n], alone, rtol=0, atol=1e-12)
        start += n
    torch.testing.assert_close(next_state, alone_state, rtol=0, atol=0)  # the last document's window only
    # without documents: torch's depthwise convolution over the state and the inputs
    plain, _ = causal_conv1d(x, weight, bias, state=state)
    expected = F.conv1d(torch.cat([state, x], 1).transpose(1, 2), weight[:, None], bias, groups=channels)
    torch.testing.assert_close(plain, expected.transpose(1, 2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
def test_decoding_step_by_step_equals_chunked(per_channel):
    x, _ = inputs(batch=2, seq=19, per_channel=per_channel)
    whole, whole_state = chunk_gated_delta_rule(*x, chunk_size=8, output_final_state=True, use_qk_l2norm=True)
    # prefill 7 tokens in chunks, then one token at a time with the carried state
    out, state = chunk_gated_delta_rule(*(t[:, :7] for t in x), chunk_size=8, output_final_state=True,
                                        use_qk_l2norm=True)
    steps = [out]
    for t in range(7, 19):
        out, state = recurrent_gated_delta_rule(*(y[:, t:t + 1] for y in x), initial_state=state,
                                                output_final_state=True, use_qk_l2norm=True)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, whole_state, rtol=0, atol=1e-10)
    # the convolution one token at a time with its carried window
    gen = torch.Generator().manual_seed(2)
    seq = torch.randn(2, 9, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    conv_whole, conv_state = causal_conv1d(seq, weight)
    window = None
    for t in range(9):
        step, window = causal_conv1d(seq[:, t:t + 1], weight, state=window)
        torch.testing.assert_close(step, conv_whole[:, t:t + 1], rtol=0, atol=1e-12)
    torch.testing.assert_close(window, conv_state, rtol=0, atol=0)


def _assert_rules_equal(x, state, l2: bool, their_chunked, their_recurrent) -> None:
    """Our chunked and recurrent rules equal transformers' (fp32, within 1e-5), outputs and final states; without
    `l2` the keys are normalised outside the rule (unnormalised random keys make it unstable: |beta k.k| > 2)."""
    if not l2:
        x = (l2norm(x[0]), l2norm(x[1]), *x[2:])
    for ours, theirs, kw in ((chunk_gated_delta_rule, their_chunked, {"chunk_size": 16}),
                             (recurrent_gated_delta_rule, their_recurrent, {})):
        out, final = ours(*x, initial_state=state, output_final_state=True, use_qk_l2norm=l2, **kw)
        ref, ref_final = theirs(*x, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(final, ref_final, rtol=0, atol=1e-5)


@pytest.mark.parametrize("l2", [False, True])
def test_equals_transformers_qwen3_next_fp32(l2):
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x, state = inputs(seq=45, dtype=torch.float32)  # 2 key heads for 4 value heads, as Qwen3-Next groups them
    _assert_rules_equal(x, state, l2, hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)


@pytest.mark.parametrize("l2", [False, True])
def test_per_channel_equals_transformers_kimi_linear_fp32(l2):
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x, state = inputs(seq=45, k_heads=4, dv=8, dtype=torch.float32, per_channel=True)  # KDA: as many q/k as v heads
    _assert_rules_equal(x, state, l2, hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention)


def test_per_channel_fast_decay_stays_finite():
    """Log decays of -50 a token: across a 64-token chunk exp(-G_j) would overflow even float64 if the within-chunk
    products were factored through the chunk's start; the blocked products refer every factor to a later point."""
    x, state = inputs(seq=70, per_channel=True)
    x = (*x[:3], x[3] * 200, x[4])
    ref, ref_state = recurrent_gated_delta_rule(*x, initial_state=state, output_final_state=True, use_qk_l2norm=True)
    leaves = [t.clone().requires_grad_() for t in x]
    out, final = chunk_gated_delta_rule(*leaves, chunk_size=64, initial_state=state, output_final_state=True,
                                        use_qk_l2norm=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, ref_state, rtol=0, atol=1e-10)
    (out.sum() + final.sum()).backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in leaves)


def test_half_precision_computes_in_float32():
    x, state = inputs(seq=12, dtype=torch.float32)
    out, final = chunk_gated_delta_rule(*(t.bfloat16() for t in x), chunk_size=4, initial_state=state.bfloat16(),
                                        output_final_state=True)
    ref, _ = recurrent_gated_delta_rule(*(t.bfloat16().double() for t in x), initial_state=state.bfloat16().double())
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_shape_errors_name_the_expected_shape():
    x, state = inputs()
    with pytest.raises(ValueError, match=r"value heads \(4\) must be a multiple of key heads \(3\)"):
        chunk_gated_delta_rule(x[0][:, :, :1].expand(-1, -1, 3, -1), x[1][:, :, :1].expand(-1, -1, 3, -1), *x[2:])
    with pytest.raises(ValueError, match=r"initial_state must be \(B, H, Dk, Dv\)"):
        chunk_gated_delta_rule(*x, initial_state=state[:, :2])
    with pytest.raises(ValueError, match=r"doc_ids must be \(B, T\)"):
        recurrent_gated_delta_rule(*x, doc_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"conv state must be \(B, W-1, C\)"):
        causal_conv1d(torch.zeros(1, 3, 2), torch.zeros(2, 4), state=torch.zeros(1, 4, 2))
