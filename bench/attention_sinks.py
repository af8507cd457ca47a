"""Attention sinks on every backend against the math path, and the kernel QK-clip's recording runs, side by side.

Per backend of `model.attention.backend` (sdpa, flash, efficient, cudnn, blockwise): one gpt-oss-shaped attention
layer with sinks (`attention.sinks = true`), forward + backward, its largest relative error in the output and in
the sinks' gradient against the math backend given the same weights and input, and its median time. The SDPA
kernels take the sinks as one extra zero-value key in heads widened to a multiple of 8 (model/attention.py,
`sink_as_key`): on a GPU this is where flash, cuDNN and the memory-efficient kernel meet them. A last row times the
blockwise kernel recording each head's largest logit (`optim.qk_clip_threshold`, train/qk_clip.py) against flash
without recording: the cost of QK-clip on that GPU. One JSON line per row.

    python bench/attention_sinks.py --device cuda --dtype bf16          # gpt-oss's heads (64 x 64, 8 KV heads)
    python bench/attention_sinks.py --device cpu --dtype fp32 --shape tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshformer.config.migrate import model_from_flat
from meshformer.model.attention import Attention
from meshformer.model.masks import build_mask

SHAPES = {  # batch, sequence, d_model, query heads, key/value heads, head width
    "gpt-oss": (2, 4096, 2880, 64, 8, 64),
    "tiny": (2, 64, 64, 4, 2, 16),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _layer(shape: tuple[int, ...], backend: str, device: str, dtype: torch.dtype, record: bool = False) -> Attention:
    _, seq, d_model, heads, kv_heads, head_dim = shape
    cfg = model_from_flat(vocab_size=64, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
                          n_layers=1, max_seq_len=seq, position="rope", bias=True, attention_sinks=True,
                          attention_backend=backend)
    torch.manual_seed(0)  # every backend gets the same weights
    layer = Attention(cfg, causal=True).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.sinks.weight.normal_(0.0, 1.0)  # sinks that matter: about a score's size
    layer.record_max_logit = record
    return layer


def _run(layer: Attention, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    mask = build_mask(x.shape[1], x.shape[1], causal=True, device=x.device)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = layer(x, mask)
    out.backward(grad)
    if x.is_cuda:
        torch.cuda.synchronize()
    return out.detach().float(), layer.sinks.weight.grad.detach().float(), time.perf_counter() - start


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--shape", choices=SHAPES, default="gpt-oss")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shape, dtype = SHAPES[args.shape], DTYPES[args.dtype]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape[0], shape[1], shape[2], generator=g).to(args.device, dtype)
    grad = torch.randn(x.shape, generator=g).to(args.device, dtype)
    reference = _layer(shape, "math", args.device, dtype)
    want_out, want_grad, _ = _run(reference, x, grad)
    del reference
    backends = ["sdpa", "flash", "efficient", "cudnn", "blockwise"]
    for backend in backends:
        layer = _layer(shape, backend, args.device, dtype)
        runs = [_run(layer, x, grad) for _ in range(args.rounds + 1)]  # the first warms up
        out, sink_grad, _ = runs[-1]
        print(json.dumps({"bench": "attention_sinks", "backend": backend, "shape": args.shape, "dtype": args.dtype,
                          "device": args.device, "out_rel_err": _rel(out, want_out),
                          "sink_grad_rel_err": _rel(sink_grad, want_grad),
                          "ms": 1e3 * statistics.median(r[2] for r in runs[1:])}), flush=True)
    times = {}
    for name, backend, record in (("flash", "flash", False), ("blockwise_recording", "auto", True)):
        layer = _layer(shape, backend, args.device, dtype, record=record)
        times[name] = statistics.median(_run(layer, x, grad)[2] for _ in range(args.rounds + 1))
    print(json.dumps({"bench": "attention_sinks", "row": "qk_clip_kernel", "shape": args.shape, "dtype": args.dtype,
                      "device": args.device, "flash_ms": 1e3 * times["flash"],
                      "recording_ms": 1e3 * times["blockwise_recording"],
                      "recording_over_flash": times["blockwise_recording"] / times["flash"]}), flush=True)


if __name__ == "__main__":
    main()
