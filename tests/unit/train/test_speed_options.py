"""GPU speed options, wired and checked on CPU: the preferred SDPA kernel (model.attention.backend), the inductor
mode (train.compile_mode), FP8 with the end blocks in high precision (train.fp8_keep_ends), the multi-tensor
gradient norm and clipping folded into the fused AdamW update. Their speed is measured by bench/gpu_sweep.sh, not
here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.parallel import build_cpu_plan, make_batches, make_config, new_model
from torch import nn
from torch.nn.attention import SDPBackend

from meshformer.config import ConfigError, ModelConfig, OptimConfig, ScheduleConfig, load_config
from meshformer.config.migrate import model_from_flat
from meshformer.model import Transformer
from meshformer.model.attention import sdpa_order
from meshformer.model.masks import build_mask
from meshformer.optim import AdamWConfig
from meshformer.parallel import float8 as float8_module
from meshformer.parallel.float8 import apply_float8, end_blocks
from meshformer.parallel.grad_norm import global_grad_norm
from meshformer.train.optim import is_fused_adam
from meshformer.train.step import TrainStep


def attention_pair(backend: str, **model) -> tuple[nn.Module, nn.Module]:
    cfg = dict(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, d_ff=48, max_seq_len=24, dropout=0.0,
               **model)
    torch.manual_seed(0)
    reference = Transformer(model_from_flat(**cfg)).decoder_layers["0"].attn
    torch.manual_seed(0)
    preferred = Transformer(model_from_flat(**{**cfg, "attention_backend": backend})).decoder_layers["0"].attn
    return reference, preferred


def test_sdpa_order_puts_the_chosen_kernel_first_and_keeps_the_rest():
    assert sdpa_order("sdpa") is None and sdpa_order("math") is None
    order = sdpa_order("cudnn")
    assert order[0] == SDPBackend.CUDNN_ATTENTION and SDPBackend.MATH in order
    assert sorted(order, key=int) == sorted(sdpa_order("flash"), key=int)  # same kernels, another first one


@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
@pytest.mark.parametrize("masking", ["causal", "padded"])
def test_preferred_sdpa_kernel_matches_default_and_falls_back_on_cpu(backend, masking, monkeypatch):
    """cuDNN / efficient kernels do not exist on CPU (and flash takes no padding mask on CUDA): the call must still
    run on the next kernel, with the same outputs and gradients as torch's own choice."""
    reference, preferred = attention_pair(backend)
    padding = torch.tensor([[True] * 9, [True] * 5 + [False] * 4]) if masking == "padded" else None
    mask = build_mask(9, 9, causal=True, key_padding=padding)
    x = torch.randn(2, 9, 32, requires_grad=True)
    expected = reference(x, mask)
    (grad_expected,) = torch.autograd.grad(expected.sum(), x)
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        seen.append(torch._C._get_sdp_priority_order()[0])  # the kernel torch tries first during this call
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    got = preferred(x, mask)
    (grad_got,) = torch.autograd.grad(got.sum(), x)
    assert seen == [int(sdpa_order(backend)[0])]
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(grad_got, grad_expected)


def test_preferred_sdpa_kernel_compiles_without_graph_break():
    reference, preferred = attention_pair("cudnn", position="rope")
    x = torch.randn(2, 9, 32)
    mask = build_mask(9, 9, causal=True)
    compiled = torch.compile(preferred, fullgraph=True)  # a graph break would raise here
    torch.testing.assert_close(compiled(x, mask), reference(x, mask), rtol=1e-5, atol=1e-6)


def test_compile_mode_reaches_torch_compile(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    cfg = make_config("decoder", compile="blocks", compile_mode="max-autotune-no-cudagraphs")
    plan = build_cpu_plan(cfg)
    assert calls and all(c == {"mode": "max-autotune-no-cudagraphs"} for c in calls)
    assert plan.report["compile"].endswith("blocks, mode max-autotune-no-cudagraphs)")
    calls.clear()
    cfg = make_config("decoder", compile="model")
    plan = build_cpu_plan(cfg)
    assert calls == [{}] and plan.report["compile"] == "whole-model torch.compile"


@pytest.mark.parametrize("override", ["train.compile_mode=fastest", "model.attention.backend=flash3"])
def test_unknown_compile_mode_and_attention_backend_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].split(".")[1]):
        load_config("configs/tiny-gpt.toml", [override])


def test_end_blocks_names_first_and_last_block_of_each_stack():
    assert end_blocks(ModelConfig(n_layers=4)) == {"decoder_layers.0", "decoder_layers.3"}
    assert end_blocks(ModelConfig(family="encoder_decoder", n_encoder_layers=1, n_decoder_layers=3)) == {
        "encoder_layers.0", "decoder_layers.0", "decoder_layers.2"}


def test_fp8_keep_ends_leaves_end_blocks_in_high_precision(monkeypatch):
    pytest.importorskip("torchao.float8", reason="torchao is the optional 'fp8' extra: pip install .[fp8]")
    monkeypatch.setattr(float8_module, "fp8_supported", lambda device: True)  # CPU: torchao emulation
    cfg = make_config("decoder", fp8="tensorwise", fp8_keep_ends=True)
    plan = build_cpu_plan(cfg)
    layers = plan.model.decoder_layers
    last = str(cfg.model.n_layers - 1)
    kinds = {name: {type(m).__name__ for m in block.modules() if isinstance(m, nn.Linear)}
             for name, block in layers.items()}
    assert kinds["0"] == kinds[last] == {"Linear"}
    assert all(kinds[n] == {"Float8Linear"} for n in layers if n not in ("0", last))
    assert "high precision: decoder_layers.0, decoder_layers." + last in plan.report["fp8"]
    batch = make_batches(cfg, 1)[0]
    loss = plan.forward_backward(batch, plan.global_token_count([batch]))
    assert torch.isfinite(loss)


def test_fp8_keep_filter_applies_to_named_blocks_only():
    pytest.importorskip("torchao.float8", reason="torchao is the optional 'fp8' extra: pip install .[fp8]")
    model = nn.Module()
    model.decoder_layers = nn.ModuleDict({str(i): nn.Linear(32, 32) for i in range(12)})
    assert apply_float8(model, "tensorwise", emulate=True, keep={"decoder_layers.1", "decoder_layers.11"}) == 10
    assert type(model.decoder_layers["1"]) is nn.Linear and type(model.decoder_layers["11"]) is nn.Linear
    assert type(model.decoder_layers["10"]) is not nn.Linear  # "decoder_layers.1" is not a prefix match of 10


def test_multi_tensor_grad_norm_matches_per_tensor_sum():
    torch.manual_seed(0)
    grads = [torch.randn(7, 5), torch.randn(3), torch.randn(4, 4, dtype=torch.bfloat16), torch.empty(0)]
    expected = torch.sqrt(sum(g.double().square().sum() for g in grads))
    got = global_grad_norm(grads, 1, torch.device("cpu"))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    # replicated copies count once: two ranks per stage holding whole tensors halve the squared sum
    torch.testing.assert_close(global_grad_norm(grads, 2, torch.device("cpu")).double(), expected / 2**0.5,
                               rtol=1e-6, atol=0)


def record_scales(plan, scaled: list[float]):
    def scale_grads_(coef: torch.Tensor) -> None:
        scaled.append(float(coef))
        type(plan).scale_grads_(plan, coef)

    return scale_grads_


@pytest.mark.parametrize("max_norm", [0.05, 1e3])  # clipping on every step / never
def test_clip_folded_into_fused_adamw_equals_clipping_the_gradients(max_norm):
    cfg = make_config("decoder")
    batches = make_batches(cfg, 3)
    weights = {}
    for kernel in ("fused", "foreach"):
        plan = build_cpu_plan(cfg)
        optim = OptimConfig(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, grad_clip=max_norm,
                            adamw=AdamWConfig(implementation=kernel))
        training = TrainStep(plan, optim, ScheduleConfig(name="constant", warmup_steps=0), len(batches), d_model=1)
        scaled: list[float] = []
        plan.scale_grads_ = record_scales(plan, scaled)
        for batch in batches:
            norm = training.step([batch]).grad_norm
            if kernel == "fused":  # the gradients stay as they are and the update divides them by the clip factor
                assert not scaled
                torch.testing.assert_close(training.optimizer.grad_scale, torch.clamp(norm / max_norm, min=1.0))
            else:  # a separate pass scales the gradients
                assert scaled.pop() == pytest.approx(min(1.0, max_norm / float(norm)), rel=1e-5)
        weights[kernel] = [p.detach().clone() for p in plan.model.parameters()]
    for folded, clipped in zip(weights["fused"], weights["foreach"]):
        torch.testing.assert_close(folded, clipped, rtol=1e-5, atol=1e-6)  # unclipped: 1.6e-2 apart


def test_only_fused_adam_scales_gradients_in_its_update():
    params = [nn.Parameter(torch.ones(2))]
    assert is_fused_adam(torch.optim.AdamW(params, fused=True))
    assert is_fused_adam(torch.optim.Adam(params, fused=True))
    assert not is_fused_adam(torch.optim.AdamW(params, foreach=True))  # its update asserts grad_scale is None
    assert not is_fused_adam(torch.optim.SGD(params, lr=0.1))


def test_compiled_run_compiles_the_plain_loss_with_equal_values_and_gradients(monkeypatch):
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: None)  # blocks stay eager: only the loss compiles
    cfg = make_config("decoder", compile="blocks", loss="plain")  # label smoothing 0.1 and z-loss 1e-3
    plan = build_cpu_plan(cfg)
    assert plan.report["loss"] == "plain (full logits, compiled)"
    eager = build_cpu_plan(make_config("decoder", loss="plain"), new_model(cfg))
    assert eager.report["loss"] == "plain (full logits)"
    labels = make_batches(cfg, 1)[0]["labels"]  # with ignored positions
    logits = torch.randn(*labels.shape, cfg.model.vocab_size, dtype=torch.bfloat16, requires_grad=True)
    expected = eager.loss_fn(logits, labels)
    (grad_expected,) = torch.autograd.grad(expected, logits)
    got = plan.loss_fn(logits, labels)
    (grad_got,) = torch.autograd.grad(got, logits)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad_got.float(), grad_expected.float(), rtol=1e-2, atol=1e-3)
