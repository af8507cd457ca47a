"""Rename/pack/transpose rules between our state dict and another implementation's, applied both ways.

The rules themselves are each family's name maps (model/families/, `FamilySpec.name_maps`); a `Rule` ties
one foreign tensor to one or more of ours (model/families/naming.py). Importing needs our shapes to split
packed tensors; they come from a model built on the meta device, which costs no memory even for
175B-parameter configs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from meshformer.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.model.families.naming import Rule


def name_map(cfg: ModelConfig, foreign: str) -> list[Rule]:
    """The rules between `cfg`'s model and the implementation named `foreign`, from its family's spec."""
    spec = get_family_spec(cfg.family)
    if foreign not in spec.name_maps:
        raise ValueError(f"a {cfg.family} model has no {foreign} name map (it has {sorted(spec.name_maps)})")
    return spec.name_maps[foreign](cfg)


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


def check_names(ours: Iterable[str], cfg: ModelConfig, shapes: Mapping[str, torch.Size], leftovers: Iterable[str],
                source: str) -> None:
    """Refuse to drop foreign weights silently (`leftovers`) or to leave a tensor of ours without a source (`ours`:
    the names the conversion produces; the tied output needs none)."""
    leftovers = sorted(leftovers)
    if leftovers:
        raise ValueError(f"{source} tensors with no meshformer counterpart (not loaded): {leftovers[:8]}"
                         f"{' ...' if len(leftovers) > 8 else ''}")
    tied = {"output.weight"} if cfg.tie_embeddings else set()
    missing = sorted(set(shapes) - set(ours) - tied)
    if missing:
        raise ValueError(f"conversion from {source} left meshformer tensors unset: {missing[:8]}")


def finish_import(out: dict[str, torch.Tensor], cfg: ModelConfig, shapes: Mapping[str, torch.Size],
                  leftovers: Iterable[str], source: str) -> dict[str, torch.Tensor]:
    """Check the names (`check_names`) and restore the tied output."""
    check_names(out, cfg, shapes, leftovers, source)
    if cfg.tie_embeddings and "output.weight" in shapes:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
