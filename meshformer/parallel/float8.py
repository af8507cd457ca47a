"""FP8 training through torchao's float8 linears (train.fp8 = "tensorwise" | "rowwise").

The block projections become `Float8Linear`s: inputs, weights and output gradients are scaled to float8
per tensor (tensorwise) or per row (rowwise) and multiplied on the FP8 tensor cores (`torch._scaled_mm`);
master weights, optimizer state and everything else stay as they were. Under FSDP2 the tensorwise recipe
all-gathers weights already cast to float8 (half the bytes of bf16). The output head and projections whose
sizes are not multiples of 16 (a `_scaled_mm` requirement) stay in high precision, as in torchtitan.

Under tensor parallelism the tensorwise recipe all-gathers activations (and output gradients) in float8
instead (tensor_parallel.py), and FSDP gathers weights in high precision: torchao's FSDP float8 all-gather
takes the weight's amax over the data-parallel shards only, so on a 2-D mesh each tensor-parallel shard would
get its own scale and its gradients would leave the single-process FP8 reference (parallel/README.md).

torchao's emulation mode runs the same scaling maths with ordinary matmuls, which is how CPU tests cover
the wiring; a real run needs CUDA compute capability 8.9+ (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection

import torch
from torch import nn

from meshformer.config import ConfigError, ModelConfig
from meshformer.model.families import get_family_spec

FP8_RECIPES = ("tensorwise", "rowwise")


def fp8_supported(device: torch.device) -> bool:
    """Whether this device has FP8 tensor cores."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_fp8(recipe: str, device: torch.device) -> None:
    """Refuse train.fp8 where it cannot run, before any work is done."""
    if recipe == "off":
        return
    if not fp8_supported(device):
        where = (f"CUDA compute capability {torch.cuda.get_device_capability(device)}" if device.type == "cuda"
                 else f"device {device.type!r}")
        raise ConfigError(f"train.fp8={recipe!r} needs FP8 tensor cores (CUDA compute capability 8.9+: Ada, Hopper, "
                          f"Blackwell) but this run is on {where}; set train.fp8='off'")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"train.fp8={recipe!r} needs torchao: pip install 'meshformer[fp8]' (torchao>=0.17)"
                          ) from None


def end_blocks(model_cfg: ModelConfig) -> frozenset[str]:
    """The first and last block of each stack (train.fp8_keep_ends keeps their linears in high precision: the
    layers nearest the embeddings and the head are the ones most sensitive to quantisation error)."""
    ends: set[str] = set()
    for stack in get_family_spec(model_cfg.family).stacks:
        depth = stack.count(model_cfg)
        if depth:
            ends |= {f"{stack.layers}.0", f"{stack.layers}.{depth - 1}"}
    return frozenset(ends)


def _convertible(module: nn.Module, fqn: str, keep: Collection[str] = ()) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    in_block = fqn.startswith(("decoder_layers.", "encoder_layers.", "layers."))
    if ".".join(fqn.split(".")[:2]) in keep:
        return False
    return in_block and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe: str, *, fsdp_gather: bool = False, emulate: bool = False,
                 keep: Collection[str] = ()) -> int:
    """Swap the block linears of `model` for torchao Float8Linear in place; returns how many were swapped.

    `fsdp_gather`: FSDP will shard the model (without tensor parallelism) and may all-gather float8 weights.
    `keep`: blocks ("decoder_layers.0", ...) whose linears stay in high precision (see `end_blocks`)."""
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8={recipe!r} is not one of {list(FP8_RECIPES)}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    # FP8 all-gather is a tensorwise feature (rowwise scales depend on the full tensor layout).
    config = dataclasses.replace(config, emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_gather and recipe == "tensorwise")
    before = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=config, module_filter_fn=functools.partial(_convertible, keep=keep))
    after = sum(type(m) is nn.Linear for m in model.modules())
    return before - after


def refresh_weight_scales(parts: Collection[nn.Module]) -> None:
    """FSDP's float8 weight all-gather: every float8 weight's scale from one all-reduce (of all their amaxes), for the
    all-gathers until the next call. Without it each all-gather reduces its weight's amax on its own: one small,
    latency-bound all-reduce per weight in the forward and again in the backward (re-gathered after resharding), some
    1,100 a step at Llama-70B depth. Call it after every optimizer step."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


def fp8_report(recipe: str, converted: int, fsdp: bool, tp: bool = False) -> str:
    if recipe == "off":
        return "off"
    gather = ""
    if recipe == "tensorwise" and (fsdp or tp):
        gather = ", float8 all-gather of activations (TP)" if tp else ", float8 all-gather of weights (FSDP)"
    return f"torchao float8 {recipe} ({converted} linears{gather})"
