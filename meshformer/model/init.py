"""Initial weights as a function of (seed, parameter name) alone: the same values whatever layout holds them.

Each parameter draws from its own generator, seeded from the model's `init_seed` and the parameter's
canonical name, so a tensor-parallel shard, an FSDP shard, a pipeline stage's copy and the single-process
model all hold the same numbers. The full tensor of one parameter is generated on the target device and
this rank keeps its shard (`distribute_tensor` without communication), so at most one full tensor is in
flight and nothing loops over elements on the host.

The rules: a block component's own where it declares one (`init_rule`: attention sinks, normal(init_std) under either
method; Gated DeltaNet's A_log, dt_bias, gated norm and out_proj), and the residual kind's (mHC's mixing weights),
the multi-token prediction modules' blocks and merges as the stack's;
else norm weights 1 (less model.norm.weight_offset), every bias 0 (the experts' stacked ones too); other weights
Xavier-uniform (`init="xavier"`, the original paper) or normal(init_std), with residual outputs (o_proj, down_proj,
the experts' down_proj) scaled by 1/sqrt(2 * layers).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
from torch import nn

from meshformer.model.components import block_mixers
from meshformer.model.components.base import InitFn
from meshformer.model.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.model.residual import residual_kind


def new_seed() -> int:
    """A model's init seed, drawn from the global CPU RNG: `torch.manual_seed(s)` then fixes every weight."""
    return int(torch.randint(0, 2**62, (), device="cpu"))


def parameter_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _component_rule(name: str, cfg: ModelConfig) -> InitFn | None:
    """The rule the block component holding `name` declares for it, if any (`<stack>_layers.<i>.<mixer>.<...>`)."""
    parts = name.split(".")
    if len(parts) < 4 or not parts[0].endswith("_layers") or not parts[1].isdigit():
        return None
    stack = next((s for s in get_family_spec(cfg.family).stacks if s.layers == parts[0]), None)
    if stack is None:
        return None
    mixer = block_mixers(cfg, int(parts[1]), cross=stack.cross).get(parts[2])
    return mixer.init_rule(cfg, ".".join(parts[3:])) if mixer is not None else None


def _mtp_rule(name: str, cfg: ModelConfig) -> InitFn | None:
    """A multi-token prediction module's (`mtp_layers.<k>.`) parameter as its block's components, branch joins and
    its merge declare, like the stack's (`block.<...>` as a block of its kinds, `merge.<...>` as a stack's merge)."""
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "mtp_layers":
        return None
    if parts[2] == "merge":
        return residual_kind(cfg).init_rule(cfg, parts[-1])
    if parts[2] != "block":
        return None
    if len(parts) == 5 and parts[3].endswith("_residual"):
        return residual_kind(cfg).init_rule(cfg, parts[-1])
    from meshformer.model.mtp import block_kinds  # mtp builds blocks, which this module initialises

    kinds, index = block_kinds(cfg)
    mixer = block_mixers(kinds, index, cross=False).get(parts[3])
    return mixer.init_rule(kinds, ".".join(parts[4:])) if mixer is not None else None


def _residual_rule(name: str, cfg: ModelConfig) -> InitFn | None:
    """The rule the residual kind declares for a parameter of a block's branch join (`<stack>_layers.<i>.
    <branch>_residual.<...>`) or a stack's merge (`<stack>_merge.<...>`)."""
    parts = name.split(".")
    if (len(parts) == 4 and parts[2].endswith("_residual")) or (len(parts) == 2 and parts[0].endswith("_merge")):
        return residual_kind(cfg).init_rule(cfg, parts[-1])
    return None


def init_rule(name: str, cfg: ModelConfig) -> InitFn:
    """How the parameter called `name` (canonical FQN) is initialised: as its block component or the residual kind
    declares, else by the rules above."""
    declared = _component_rule(name, cfg) or _residual_rule(name, cfg) or _mtp_rule(name, cfg)
    if declared is not None:
        return declared
    module, _, kind = name.rpartition(".")
    if kind == "bias" or kind.endswith("_bias"):  # the experts' stacked gate_bias / up_bias / down_bias too
        return lambda t, g: t.zero_()
    if module.endswith("norm"):  # a unit scale: (offset + weight) = 1
        return lambda t, g: t.fill_(1.0 - cfg.norm.weight_offset)
    if cfg.init.method == "xavier":
        return _xavier
    std = cfg.init.std
    if name.removesuffix(".weight").endswith(("o_proj", "down_proj")):  # experts' stacked down_proj too
        std = cfg.init.std / math.sqrt(2 * get_family_spec(cfg.family).total_layers(cfg))
    return lambda t, g: nn.init.normal_(t, std=std, generator=g)


def _xavier(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Xavier-uniform; stacked experts (E, in, out) each over their own fans."""
    for matrix in t if t.dim() == 3 else (t,):
        nn.init.xavier_uniform_(matrix, generator=g)
    return t


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, cfg: ModelConfig, seed: int) -> None:
    """Fill `param` (plain or DTensor) with its share of the full tensor the rules give `name`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = param.to_local() if isinstance(param, DTensor) else param
    generator = torch.Generator(device=local.device).manual_seed(parameter_seed(seed, name))
    rule = init_rule(name, cfg)
    if not isinstance(param, DTensor):
        rule(param, generator)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
    rule(full, generator)
    # src_data_rank=None: every rank generated the same full tensor, so each keeps its slice, no communication.
    local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local())


@torch.no_grad()
def init_weights(parameters: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, seed: int) -> None:
    """Initialise each (canonical name, parameter) of a model or a part of one (sharded or not); meta ones stay.

    The names are the whole model's (`Transformer.canonical_parameters`), so a pipeline stage's copy of a tied
    weight draws the same numbers as the original.
    """
    for name, param in parameters:
        if not param.is_meta:
            init_parameter(param, name, cfg, seed)


@torch.no_grad()
def init_buffers(model: nn.Module) -> None:
    """Recompute the derived buffers (RoPE tables, ALiBi slopes, sinusoidal tables) where they now live."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
