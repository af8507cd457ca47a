"""train.fp8: refused without FP8 tensor cores; on CPU the torchao wiring runs through its emulated float8."""

from __future__ import annotations

import pytest
import torch
from helpers.parallel import build_cpu_plan, make_batches, make_config

from meshformer.config import ConfigError
from meshformer.parallel import float8 as float8_module
from meshformer.parallel.float8 import apply_float8, check_fp8


def test_fp8_is_refused_without_fp8_tensor_cores():
    with pytest.raises(ConfigError, match=r"train.fp8='tensorwise' needs FP8 tensor cores .* set train.fp8='off'"):
        check_fp8("tensorwise", torch.device("cpu"))
    check_fp8("off", torch.device("cpu"))  # off is always fine
    cfg = make_config("decoder", fp8="rowwise")
    with pytest.raises(ConfigError, match="needs FP8 tensor cores"):
        build_cpu_plan(cfg)


def needs_torchao() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is the optional 'fp8' extra: pip install .[fp8]")


def llama_config(**train):
    # Projections must be multiples of 16 for float8 matmuls: d 32, d_ff 64, 4 heads of 8, 2 kv heads.
    return make_config("decoder", **train)


def bf16_step(plan, batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    plan.autocast_dtype = torch.bfloat16
    tokens = plan.global_token_count(batches)
    loss = sum(plan.forward_backward(b, tokens) for b in batches) / tokens
    return loss, {n: p.grad for n, p in plan.model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulated_fp8_converts_block_linears_and_trains_close_to_bf16(recipe, monkeypatch):
    needs_torchao()
    cfg = llama_config()
    batches = make_batches(cfg, 2)
    ref_loss, ref_grads = bf16_step(build_cpu_plan(cfg), batches)

    monkeypatch.setattr(float8_module, "fp8_supported", lambda device: True)  # CPU: torchao emulation
    cfg.train.fp8 = recipe
    plan = build_cpu_plan(cfg)
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in plan.model.decoder_layers.modules())
    assert plan.report["fp8"] == f"torchao float8 {recipe} ({n_linear} linears)"
    assert type(plan.model.output) is torch.nn.Linear  # the head stays in high precision
    loss, grads = bf16_step(plan, batches)
    assert abs(loss.item() / ref_loss.item() - 1) < 0.02
    assert grads.keys() == ref_grads.keys()  # parameter names unchanged: checkpoints still load
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert (grad - ref_grads[name]).norm() <= 0.25 * ref_grads[name].norm() + 1e-6, name


def test_linears_with_sizes_not_multiple_of_16_stay_high_precision():
    needs_torchao()
    model = torch.nn.Module()
    model.decoder_layers = torch.nn.ModuleDict({"0": torch.nn.Sequential(torch.nn.Linear(32, 48),
                                                                          torch.nn.Linear(48, 20))})
    assert apply_float8(model, "tensorwise", emulate=True) == 1
    assert type(model.decoder_layers["0"][1]) is torch.nn.Linear
