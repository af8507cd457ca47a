"""The CPU speed paths keep the model's maths: Q/K/V packed into one GEMM, and the host allocator policy."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshformer.config import AttentionConfig, FfnConfig, ModelConfig
from meshformer.model.attention import Attention
from meshformer.model.masks import build_mask
from meshformer.runtime.host_memory import ENV_MMAP_THRESHOLD, reuse_freed_host_memory


def attention(bias: bool, kv_heads: int | None = None) -> Attention:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, max_seq_len=16, dropout=0.0, bias=bias,
                      attention=AttentionConfig(n_heads=4, n_kv_heads=kv_heads), ffn=FfnConfig(d_ff=48))
    return Attention(cfg, causal=True)


def separate_projections(attn: Attention) -> None:
    """Make the projections opt out of packing (a Linear subclass runs its own forward)."""
    for name in ("q_proj", "k_proj", "v_proj"):
        plain = getattr(attn, name)
        swapped = type("OwnForwardLinear", (nn.Linear,), {})(plain.in_features, plain.out_features,
                                                            bias=plain.bias is not None)
        swapped.load_state_dict(plain.state_dict())
        setattr(attn, name, swapped)


@pytest.mark.parametrize("bias,kv_heads,dtype", [(True, None, torch.float32), (False, 2, torch.float32),
                                                 (True, None, torch.bfloat16)])
def test_packed_qkv_matches_three_projections(bias, kv_heads, dtype):
    attn = attention(bias, kv_heads)
    assert attn._packable()
    x = torch.randn(2, 16, 32, requires_grad=True)
    mask = build_mask(16, 16, causal=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        packed = attn(x, mask)
    packed.float().square().sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in attn.parameters())]
    x.grad = None
    attn.zero_grad()
    separate_projections(attn)
    assert not attn._packable()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        separate = attn(x, mask)
    separate.float().square().sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(packed, separate, **tol)
    for got, want in zip(grads, [x.grad, *(p.grad for p in attn.parameters())], strict=True):
        torch.testing.assert_close(got, want, **tol)


def test_hooked_projection_is_not_packed():
    attn = attention(True)
    seen = []
    attn.k_proj.register_forward_hook(lambda *_: seen.append(1))
    assert not attn._packable()
    attn(torch.randn(1, 4, 32), build_mask(4, 4, causal=True))
    assert seen == [1]


def test_freed_host_memory_reused_only_for_one_cpu_process(monkeypatch):
    monkeypatch.delenv(ENV_MMAP_THRESHOLD, raising=False)
    assert not reuse_freed_host_memory("cuda", 1)
    assert not reuse_freed_host_memory("cpu", 4)  # multi-rank CPU runs map large blocks instead (freed RSS)
    monkeypatch.setenv(ENV_MMAP_THRESHOLD, "1048576")  # an explicit allocator choice wins
    assert not reuse_freed_host_memory("cpu", 1)
