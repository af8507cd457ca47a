"""The GEMM ceiling of this device: bf16 (and FP8 `_scaled_mm` where there are FP8 tensor cores) TFLOP/s.

    python bench/gemm_ceiling.py [--n 8192] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def rate(fn, flops: float, seconds: float, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            fn()
        count += 10
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return flops * count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device, n = torch.device(args.device), args.n
    flops = 2.0 * n**3
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    record = {"bench": "gemm_ceiling", "n": n, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "bf16_tflops": round(rate(lambda: a @ b, flops, args.seconds, device) / 1e12, 3)}
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major second operand, as _scaled_mm wants
        one = torch.ones((), device=device)
        record["fp8_tflops"] = round(rate(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
                                          flops, args.seconds, device) / 1e12, 1)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
