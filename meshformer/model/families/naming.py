"""`Rule`: one foreign tensor tied to one or more of ours; the families' name maps are lists of them.

Several of ours are concatenated along dim 0 (output features), e.g. q/k/v into GPT-2's `c_attn` or
nn.MultiheadAttention's `in_proj_weight`; or interleaved along the last dim (a fused gate/up whose even columns are
the gate); one expert's linear is a slice of our stacked (n_experts, in, out)
expert tensor (Mixtral's `experts.3.w1.weight`). checkpointing/mapping.py applies rules both ways.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshformer.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]  # our tensors, concatenated along dim 0 when several (or interleaved: `interleave`)
    theirs: str
    transpose: bool = False  # foreign layout has the last two dims swapped, e.g. GPT-2's Conv1D (in, out)
    alias: bool = False  # a foreign duplicate of a tied tensor: written on export, ignored on import
    expert: int | None = None  # the foreign tensor is this slice of our (single, stacked) tensor along dim 0
    interleave: bool = False  # several of ours alternate along the last dim: column k * len(ours) + i is ours[i]'s k
    # the foreign tensor's shape where it holds our (single) tensor's values in another shape, e.g. (1, 1, H, 1)
    theirs_shape: tuple[int, ...] | None = None
    dim: int = 0  # the dim several of ours are concatenated along (-1: stacked experts' gate and up, (E, d, 2f))


def params(ours: str | tuple[str, ...], theirs: str, names: Iterable[str] = ("weight", "bias"), *,
           transpose: bool = False) -> list[Rule]:
    """Rules for the weight/bias pair (or just the weight) of a module on both sides."""
    ours = (ours,) if isinstance(ours, str) else ours
    return [Rule(tuple(f"{o}.{n}" for o in ours), f"{theirs}.{n}", transpose) for n in names]


@dataclass(frozen=True)
class MegatronNames:
    """Our names for what a Megatron-Core model stacks per layer and packs (checkpointing/megatron.py)."""

    model: str  # the Megatron-Core class, e.g. "GPTModel"
    layers: str  # our stack: `<layers>.<i>.` prefixes every per-layer name below
    embedding: str
    positions: str
    final_norm: str
    output: str
    attn_norm: str  # Megatron folds it into linear_qkv
    ffn_norm: str  # ... and this one into linear_fc1
    qkv: tuple[str, str, str]  # packed per query group into linear_qkv
    q_norm: str  # QK-norm: self_attention.q_layernorm / k_layernorm
    k_norm: str
    attn_out: str
    gate: str  # SwiGLU: linear_fc1 = [gate; up]
    up: str
    down: str
    moe: str  # an MoE block's feed-forward module: router, experts and shared experts (their gate/up/down leaves)


def expert_params(ours: str, theirs: str, n_experts: int) -> list[Rule]:
    """One (out, in) nn.Linear weight per expert (`theirs` holds "{j}") from our stacked (n_experts, in, out)
    tensor, in expert order (so a one-entry cache reads the stacked tensor once on export)."""
    return [Rule((ours,), theirs.format(j=j), transpose=True, expert=j) for j in range(n_experts)]


def norm(ours: str, theirs: str, cfg: ModelConfig) -> list[Rule]:
    """A norm's weight, and its bias where it has one (LayerNorm with model.bias)."""
    has_bias = cfg.norm.kind == "layernorm" and cfg.bias
    return params(ours, theirs, ("weight", "bias") if has_bias else ("weight",))
