"""Fused-kernel selection: apex norms only when importable (and on CUDA), names kept, and the run-log report."""

from __future__ import annotations

import sys
import types

import torch
from helpers.parallel import build_cpu_plan, make_config, new_model
from torch import nn

from meshformer.parallel.kernels import apex_available, kernel_report, use_apex_norms


class FakeFusedLayerNorm(nn.LayerNorm):
    """Stands in for apex.normalization.FusedLayerNorm (apex is not installable from the registry)."""


def test_without_apex_torch_kernels_are_used():
    if apex_available():  # pragma: no cover - a machine with apex
        return
    model = new_model(make_config("encoder"))
    assert use_apex_norms(model, torch.device("cuda")) == 0
    cfg = make_config("encoder")
    report = kernel_report(cfg, torch.device("cpu"), apex_norms=0, compiled=0, recompute=0)
    assert report["norms"] == "torch" and "not installed" in report["apex"]
    assert report["attention"].startswith("blockwise (meshformer's CPU kernel")  # model.attention_backend=auto
    assert kernel_report(cfg, torch.device("cpu"), apex_norms=0, compiled=1, recompute=0)["attention"] == \
        "SDPA (CPU flash kernel)"  # compiled blocks: inductor takes SDPA
    cfg.model.attention.backend = "sdpa"
    report = kernel_report(cfg, torch.device("cpu"), apex_norms=0, compiled=0, recompute=0)
    assert report["attention"] == "SDPA (CPU flash kernel)"


def test_apex_norms_swap_in_when_importable(monkeypatch):
    apex = types.ModuleType("apex")
    normalization = types.ModuleType("apex.normalization")
    normalization.FusedLayerNorm = FakeFusedLayerNorm
    apex.normalization = normalization
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.normalization", normalization)
    cfg = make_config("encoder")
    model = new_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_apex_norms(model, torch.device("cpu")) == 0  # CUDA only
    swapped = use_apex_norms(model, torch.device("cuda"))
    assert swapped == sum(isinstance(m, FakeFusedLayerNorm) for m in model.modules()) > 0
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_single_device_plan_reports_kernels():
    cfg = make_config("decoder", {"recompute": "selective"})
    plan = build_cpu_plan(cfg)
    assert plan.report["recompute"] == "selective (4 blocks)"
    assert plan.report["compile"] == "eager" and plan.supports_generation
