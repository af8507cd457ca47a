"""Rename/pack/transpose rules between our state dict and another implementation's, applied both ways.

A `Rule` ties one foreign tensor to one or more of ours: several of ours are concatenated along dim 0
(output features), e.g. q/k/v into GPT-2's `c_attn` or nn.MultiheadAttention's `in_proj_weight`.
Importing needs our shapes to split packed tensors; they come from a model built on the meta device,
which costs no memory even for 175B-parameter configs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from meshformer.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    ours: tuple[str, ...]  # our tensors, concatenated along dim 0 when several
    theirs: str
    transpose: bool = False  # foreign layout is (in, out), e.g. GPT-2's Conv1D
    alias: bool = False  # a foreign duplicate of a tied tensor: written on export, ignored on import


def params(ours: str | tuple[str, ...], theirs: str, names: Iterable[str] = ("weight", "bias"), *,
           transpose: bool = False) -> list[Rule]:
    """Rules for the weight/bias pair (or just the weight) of a module on both sides."""
    ours = (ours,) if isinstance(ours, str) else ours
    return [Rule(tuple(f"{o}.{n}" for o in ours), f"{theirs}.{n}", transpose) for n in names]


def our_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    from meshformer.model import Transformer

    with torch.device("meta"):
        return {k: v.shape for k, v in Transformer(cfg).state_dict().items()}


def export_tensors(ours: Mapping[str, torch.Tensor], rules: Iterable[Rule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for rule in rules:
        parts = [ours[name].detach() for name in rule.ours]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        out[rule.theirs] = tensor.t().contiguous() if rule.transpose else tensor
    return out


def import_tensors(theirs: Mapping[str, torch.Tensor], rules: Iterable[Rule], shapes: Mapping[str, torch.Size],
                   source: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Our tensors from foreign ones, and the foreign names used (aliases count as used, unread)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for rule in rules:
        used.add(rule.theirs)
        if rule.alias:
            continue
        if rule.theirs not in theirs:
            raise KeyError(f"{source} state dict lacks {rule.theirs!r} (needed for {', '.join(rule.ours)})")
        tensor = theirs[rule.theirs].detach()
        tensor = tensor.t() if rule.transpose else tensor
        sizes = [shapes[name][0] for name in rule.ours]
        pieces = tensor.split(sizes, dim=0) if len(sizes) > 1 else (tensor,)
        for name, piece in zip(rule.ours, pieces, strict=True):
            if piece.shape != shapes[name]:
                raise ValueError(f"{source} tensor {rule.theirs!r} gives {name} the shape {tuple(piece.shape)}, "
                                 f"expected {tuple(shapes[name])}; does the config match the checkpoint?")
            out[name] = piece.contiguous()
    return out, used


def finish_import(out: dict[str, torch.Tensor], cfg: ModelConfig, shapes: Mapping[str, torch.Size],
                  leftovers: Iterable[str], source: str) -> dict[str, torch.Tensor]:
    """Restore tied names and refuse to drop foreign weights silently or to return an incomplete state dict."""
    leftovers = sorted(leftovers)
    if leftovers:
        raise ValueError(f"{source} tensors with no meshformer counterpart (not loaded): {leftovers[:8]}"
                         f"{' ...' if len(leftovers) > 8 else ''}")
    if cfg.tie_embeddings and "output.weight" in shapes:
        out["output.weight"] = out["tok_embeddings.weight"]
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"conversion from {source} left meshformer tensors unset: {missing[:8]}")
    return out
