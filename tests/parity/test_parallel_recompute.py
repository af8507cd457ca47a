"""Activation recomputation changes memory, never numbers: bitwise-equal losses and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel import build_cpu_plan, make_batches, make_config, new_model
from torch.utils._python_dispatch import TorchDispatchMode

from meshformer.config import ConfigError
from meshformer.parallel.parallelize import compile_mode
from meshformer.parallel.recompute import apply_recompute
from meshformer.parallel_dims import ParallelDims

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def step(family: str, mode: str, **train):
    cfg = make_config(family, {"recompute": mode, "recompute_every": 2}, **train)
    batches = make_batches(cfg, 2)
    plan = build_cpu_plan(cfg)
    tokens = plan.global_token_count(batches)
    loss = sum(plan.forward_backward(b, tokens) for b in batches)
    return plan, loss, {n: p.grad.clone() for n, p in plan.model.named_parameters()}


@pytest.mark.parametrize("family", ["decoder", "encoder", "encdec"])
@pytest.mark.parametrize("mode", ["full", "selective", "every_k"])
def test_recompute_is_bitwise_equal(family, mode):
    _, ref_loss, ref_grads = step(family, "none")
    plan, loss, grads = step(family, mode)
    assert plan.report["recompute"].startswith(mode)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()  # names unchanged: no wrapper prefixes
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def backward_matmuls(mode: str) -> int:
    cfg = make_config("decoder", {})
    model = new_model(cfg)
    apply_recompute(model, mode, every=2)
    batch = make_batches(cfg, 1)[0]
    loss = model(batch["input_ids"]).float().square().mean()
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count


def test_selective_keeps_matmuls_full_recomputes_them():
    none, selective, full, every_2 = (backward_matmuls(m) for m in ("none", "selective", "full", "every_k"))
    per_block = (full - none) // 4  # forward matmuls of one block, replayed in backward
    assert per_block > 0 and full == none + 4 * per_block
    assert selective == none  # matmul outputs were saved, only cheap ops are recomputed
    assert every_2 == none + 2 * per_block


@pytest.mark.slow
@pytest.mark.parametrize("family", ["decoder", "moe"])  # moe: the routing/permutation glue fused by inductor
def test_per_block_compile_keeps_names_and_numbers(family):
    _, ref_loss, ref_grads = step(family, "none")
    plan, loss, grads = step(family, "none", compile=True)
    assert plan.report["compile"].startswith("per-block torch.compile (4 blocks)")
    assert grads.keys() == ref_grads.keys()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.slow
def test_whole_model_compile_keeps_names_and_numbers():
    """train.compile='model': one graph for the model (the chunked head loss runs eagerly behind a graph break)."""
    _, ref_loss, ref_grads = step("decoder", "none")
    plan, loss, grads = step("decoder", "none", compile="model")
    assert plan.report["compile"] == "whole-model torch.compile"
    assert grads.keys() == ref_grads.keys()
    assert torch.allclose(loss, ref_loss, rtol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), name


def test_compile_modes_accept_the_old_bool_and_refuse_model_compile_when_sharded():
    cfg = make_config("decoder", compile=True)
    assert compile_mode(cfg, ParallelDims(1, 1, 1, 1, 1, 1)) == "blocks"
    cfg.train.compile = False
    assert compile_mode(cfg, ParallelDims(1, 1, 1, 1, 1, 1)) == "off"
    cfg.train.compile = "model"
    with pytest.raises(ConfigError, match="train.compile='model' is for a single device"):
        compile_mode(cfg, ParallelDims(1, 1, 2, 1, 1, 2))
