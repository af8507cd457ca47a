"""The numbers users read: the MFU ceiling and where it comes from."""

import pytest
import torch

from meshformer.train import metrics
from meshformer.train.metrics import FlopsCeiling, peak_flops


def test_mfu_never_exceeds_the_ceiling_and_says_when_it_was_raised():
    ceiling = FlopsCeiling(100e9, "measured GEMM")
    assert ceiling.mfu(50e9) == (0.5, None)
    mfu, note = ceiling.mfu(150e9)  # a window beat the start-up measurement (it ran on a loaded machine)
    assert mfu == 1.0 and "raised from 0.100 to 0.150 TFLOP/s" in note
    assert ceiling.mfu(75e9) == (0.5, None)  # later windows are measured against the raised ceiling


@pytest.mark.parametrize(
    ("dtype", "tf32", "expected", "source"),
    [
        (torch.bfloat16, False, 989e12, "dense bf16"),
        (torch.float32, True, 494.5e12, "TF32 (enabled)"),
        (torch.float32, False, 67e12, "fp32 without TF32"),
    ],
)
def test_gpu_peak_follows_dtype_and_tf32(monkeypatch, dtype, tf32, expected, source):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(metrics, "tf32_enabled", lambda: tf32)
    flops, where = peak_flops(torch.device("cuda"), dtype)
    assert flops == expected and source in where and "H100 datasheet" in where


def test_tf32_enabled_reads_torch_settings():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert not metrics.tf32_enabled()
        torch.set_float32_matmul_precision("high")
        assert metrics.tf32_enabled()
    finally:
        torch.set_float32_matmul_precision(before)


def test_cpu_peak_is_measured_and_says_how():
    flops, where = peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 1e8 and "measured" in where and "best of 5" in where
