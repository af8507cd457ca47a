"""Start-up cost of initialisation: seconds per billion parameters to materialise a meta-built model on a device
and fill it by the layout-independent rule (each parameter from its own generator, on the device).

Reference, in the same run: the device's own RNG throughput, `normal_` over the same number of elements (in
buffers of the largest parameter's size), so the ratio shows what the per-parameter rule costs beyond drawing
the numbers. Also checks, at the smallest size, that the materialised weights equal the eagerly built model's
on the same device bitwise (the rule does not depend on how the model was built).

    python bench/init_speed.py [--device cuda] [--shape llama-8b] [--layers 1 4 16]

One JSON line per size: {"bench": "init_speed", "params_B", "materialise_s", "s_per_B", "rng_s_per_B", ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from meshformer.config import ModelConfig, build_section  # noqa: E402
from meshformer.model import Transformer  # noqa: E402
from meshformer.parallel.materialize import materialize  # noqa: E402

# Llama-3 layer shapes; `cpu-1b` keeps this machine's memory modest (the vocabulary is cut to 32k).
SHAPES = {
    "llama-8b": {"d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "d_ff": 14336, "vocab_size": 128256},
    "cpu-1b": {"d_model": 2048, "n_heads": 16, "n_kv_heads": 8, "d_ff": 8192, "vocab_size": 32000},
    "tiny": {"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "d_ff": 512, "vocab_size": 4096},  # dry runs
}


def model_config(shape: str, layers: int) -> ModelConfig:
    raw = {"family": "decoder", "n_layers": layers, "max_seq_len": 2048, "position": "rope", "norm": "rmsnorm",
           "activation": "swiglu", "bias": False, "init": "normal", **SHAPES[shape]}
    return build_section(ModelConfig, raw, "model")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_materialise(cfg: ModelConfig, device: torch.device, seed: int) -> tuple[Transformer, float]:
    with torch.device("meta"):
        model = Transformer(cfg, init_seed=seed)
    synchronize(device)
    start = time.perf_counter()
    materialize([model], device)
    synchronize(device)
    return model, time.perf_counter() - start


def time_rng(numel: int, largest: int, device: torch.device) -> float:
    """`normal_` over `numel` elements in buffers of `largest` elements: the device's RNG throughput."""
    buffer = torch.empty(largest, device=device)
    generator = torch.Generator(device=device).manual_seed(0)
    synchronize(device)
    start = time.perf_counter()
    left = numel
    while left > 0:
        buffer[: min(left, largest)].normal_(generator=generator)
        left -= largest
    synchronize(device)
    return time.perf_counter() - start


def bitwise_equal_to_eager(cfg: ModelConfig, device: torch.device, seed: int) -> bool:
    materialised, _ = time_materialise(cfg, device, seed)
    with torch.device(device):
        eager = Transformer(cfg, init_seed=seed)
    eager_params = dict(eager.named_parameters())
    return all(torch.equal(p, eager_params[name]) for name, p in materialised.named_parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="layer shapes (default: llama-8b on a GPU, cpu-1b on the CPU)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="sizes to measure, as layer counts (default: 1 4 16 on a GPU, 1 4 8 on the CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = args.shape or ("llama-8b" if device.type == "cuda" else "cpu-1b")
    layers = args.layers or ([1, 4, 16] if device.type == "cuda" else [1, 4, 8])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    equal = bitwise_equal_to_eager(model_config(shape, 1), device, seed=1234)
    print(json.dumps({"bench": "init_speed", "check": "materialised == eager, bitwise", "device": name,
                      "shape": shape, "ok": equal}), flush=True)
    time_materialise(model_config(shape, 1), device, seed=1)  # warm-up: kernels, allocator
    for n_layers in layers:
        model, seconds = time_materialise(model_config(shape, n_layers), device, seed=0)
        numel = sum(p.numel() for p in model.parameters())
        largest = max(p.numel() for p in model.parameters())
        del model
        rng_seconds = time_rng(numel, largest, device)
        billions = numel / 1e9
        print(json.dumps({"bench": "init_speed", "device": name, "shape": shape, "layers": n_layers,
                          "params_B": round(billions, 3), "materialise_s": round(seconds, 3),
                          "s_per_B": round(seconds / billions, 2), "rng_s_per_B": round(rng_seconds / billions, 2),
                          "vs_rng": round(seconds / rng_seconds, 2)}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not equal:
        sys.exit("materialised weights differ from the eagerly built model's")


if __name__ == "__main__":
    main()
