"""The tensor-parallel collectives inside autograd (parallel/tensor_parallel.py) use the plain, non-deprecated
all-reduce: on one rank they equal the unsplit modules, and they raise no deprecation warning (which every rank would
print once). Their sums over two ranks are checked by the parity rows decoder_olmo2/tp and deepseek/tp-ep."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from meshformer.parallel.tensor_parallel import HeadShardedRMSNorm, _SumGradient


@pytest.fixture
def one_rank(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_summed_norm_and_gradient_equal_one_rank_without_a_deprecation_warning(one_rank):
    torch.manual_seed(0)
    norm = nn.RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.add_(torch.randn(8))
    sharded = HeadShardedRMSNorm(norm, one_rank)
    x = torch.randn(3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sharded(x)
        passed = _SumGradient.apply(out, one_rank.get_group())
        passed.square().sum().backward()
    norm(x_ref).square().sum().backward()
    torch.testing.assert_close(out, norm(x_ref), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
