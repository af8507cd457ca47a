"""The blockwise CPU attention kernel: flash's accuracy, where `auto` picks it, and what the planner counts for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model import attention as attention_module
from meshformer.model.attention import Attention
from meshformer.model.blockwise_attention import blockwise_attention, stored_probabilities
from meshformer.model.config import ModelConfig
from meshformer.model.masks import build_mask


def _relative_errors(fn, q, k, v, grad, reference):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(grad)
    got = [out, q.grad, k.grad, v.grad]
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, reference, strict=True)]


CASES = [  # (batch, heads, q_len, k_len, head_dim, causal)
    (2, 3, 100, 100, 16, True),  # a last block shorter than the others
    (1, 2, 600, 600, 8, True),  # 128-row blocks above T 512
    (2, 2, 37, 70, 16, False),  # unmasked, more keys than queries (cross-attention)
    (2, 2, 40, 100, 16, True),  # causal, queries are the last 40 of 100 positions (a context-parallel piece)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "heads", "q_len", "k_len", "head_dim", "causal"), CASES)
def test_outputs_and_gradients_as_accurate_as_sdpa(dtype, batch, heads, q_len, k_len, head_dim, causal):
    """Against a float64 reference: fp32 to ~1e-6; bf16 within 2x the error of torch's CPU flash kernel on
    sharp attention (scores ~3x unit scale), which bf16-rounded scores (a plain bf16 bmm) would exceed ~5x."""
    torch.manual_seed(0)
    q = (3 * torch.randn(batch, heads, q_len, head_dim)).to(dtype).requires_grad_()
    k = (3 * torch.randn(batch, heads, k_len, head_dim)).to(dtype).requires_grad_()
    v = torch.randn(batch, heads, k_len, head_dim).to(dtype).requires_grad_()
    grad = torch.randn(batch, heads, q_len, head_dim).to(dtype)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = causal_lower_right(q_len, k_len) if causal else None  # SDPA's is_causal would align at the top left
    out64 = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask)
    out64.backward(grad.double())
    reference = [out64, q64.grad, k64.grad, v64.grad]
    scale = head_dim**-0.5
    ours = _relative_errors(lambda a, b, c: blockwise_attention(a, b, c, scale=scale, causal=causal), q, k, v, grad,
                            reference)
    sdpa = _relative_errors(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask), q, k, v, grad,
                            reference)
    if dtype == torch.float32:
        assert max(ours) < 1e-5, ours
    else:
        assert all(o < 2 * s for o, s in zip(ours, sdpa, strict=True)), (ours, sdpa)


def test_causal_needs_at_least_as_many_keys_as_queries():
    q, k = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        blockwise_attention(q, k, k, scale=1.0, causal=True)


def _tiny(**overrides) -> ModelConfig:
    base = dict(family="decoder", n_layers=1, d_model=32, n_heads=2, d_ff=64, vocab_size=50, max_seq_len=1024)
    return model_from_flat(**{**base, **overrides})  # head_dim 16: `auto` up to T 256


def _runs_blockwise(monkeypatch, attn: Attention, length: int, *, mask=None, device="cpu") -> bool:
    calls = []
    real = attention_module.blockwise_attention
    monkeypatch.setattr(attention_module, "blockwise_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(2, length, 32, device=device)
    attn(x, mask if mask is not None else build_mask(length, length, causal=True))
    return bool(calls)


@pytest.mark.parametrize(("overrides", "length", "expected"), [
    ({}, 256, True),  # auto, CPU, T <= 16 x head_dim
    ({}, 257, False),  # beyond the memory rule: SDPA
    ({"attention_backend": "sdpa"}, 64, False),
    ({"attention_backend": "flash"}, 64, False),
    ({"attention_backend": "blockwise"}, 512, True),  # forced past the rule
    ({"attention_dropout": 0.1}, 64, False),  # dropout: SDPA
])
def test_auto_picks_the_kernel_on_cpu_within_its_memory_rule(monkeypatch, overrides, length, expected):
    attn = Attention(_tiny(**overrides), causal=True)
    assert _runs_blockwise(monkeypatch, attn, length) is expected


def test_masks_biases_and_other_devices_keep_sdpa(monkeypatch):
    attn = Attention(_tiny(), causal=True)
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[0, 10:] = False
    assert not _runs_blockwise(monkeypatch, attn, 16, mask=build_mask(16, 16, causal=True, key_padding=padding))
    assert not _runs_blockwise(monkeypatch, Attention(_tiny(), causal=True).to("meta"), 16, device="meta")
    alibi = Transformer(_tiny(position="alibi"))
    calls = []
    monkeypatch.setattr(attention_module, "blockwise_attention", lambda *a, **kw: calls.append(1))
    alibi(torch.randint(0, 50, (2, 16)))
    assert not calls


def test_model_trains_the_same_on_blockwise_and_sdpa():
    """A whole decoder: loss and every parameter gradient equal to SDPA's within fp32 rounding."""
    torch.manual_seed(0)
    ours = Transformer(_tiny(n_layers=2))
    sdpa = Transformer(_tiny(n_layers=2, attention_backend="sdpa"))
    sdpa.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 50, (3, 40))
    for model in (ours, sdpa):
        F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    torch.testing.assert_close(ours(ids), sdpa(ids), rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(ours.named_parameters(), sdpa.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def _saved_bytes(model: Transformer, ids: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids)
    del out
    return sum(seen.values())


def test_planner_counts_the_kept_probabilities():
    """What one decoder block keeps more under this kernel than under SDPA, measured with saved-tensor hooks,
    equals the planner's difference (the stored probabilities minus SDPA's log-sum-exp) within 2%."""
    from meshformer.planner.activations import ActivationShape, block_saved

    cfg = _tiny(n_layers=1, n_heads=4, d_model=64)  # head_dim 16
    batch, seq = 4, 200
    ids = torch.randint(0, 50, (batch, seq))
    torch.manual_seed(0)
    ours = Transformer(cfg)
    sdpa = Transformer(_tiny(n_layers=1, n_heads=4, d_model=64, attention_backend="sdpa"))
    measured = _saved_bytes(ours, ids) - _saved_bytes(sdpa, ids)
    shape = ActivationShape(batch, seq, 1, 4, 4)
    predicted = (block_saved(cfg, ActivationShape(batch, seq, 1, 4, 4, blockwise=True))
                 - block_saved(cfg, shape))
    assert predicted == stored_probabilities(batch * 4, seq, seq, causal=True) * 4 - batch * 4 * seq * 4
    assert abs(predicted / measured - 1) < 0.02, (predicted, measured)
