"""Rename/pack/transpose rules between our state dict and another implementation's, applied both ways.

The rules themselves come from each Hugging Face architecture's adapter (meshformer/models/<model_type>/) or a
family's other name maps (model/families/, `FamilySpec.name_maps`); a `Rule` ties one foreign tensor to one or more
of ours (model/families/naming.py). Importing needs our shapes to split
packed tensors; they come from a model built on the meta device, which costs no memory even for
175B-parameter configs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from meshformer.config import ModelConfig
from meshformer.model.families import get_family_spec
from meshformer.model.families.naming import Rule

# Our buffers no foreign implementation has: zeros on import (DeepSeek-V3's expert selection bias starts at zero;
# export refuses a nonzero one, checkpointing/hf.py).
ZERO_ON_IMPORT = re.compile(r"\.router\.expert_bias$")


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


def _swap_last(tensor: torch.Tensor) -> torch.Tensor:
    """A rule's transpose: the last two dims swapped (a matrix, or each of stacked experts'); 1-D tensors as they
    are (a transposed layer's bias)."""
    return tensor.transpose(-2, -1) if tensor.ndim > 1 else tensor


def export_tensors(ours: Mapping[str, torch.Tensor], rules: Iterable[Rule]) -> dict[str, torch.Tensor]:
    return dict(iter_export(ours, rules))


def iter_export(ours: Mapping[str, torch.Tensor], rules: Iterable[Rule]) -> Iterator[tuple[str, torch.Tensor]]:
    """(foreign name, tensor) one rule at a time; the experts of one stacked tensor of ours read it once."""
    cached: tuple[tuple[str, ...], list[torch.Tensor]] | None = None
    for rule in rules:
        if cached is None or cached[0] != rule.ours:
            cached = (rule.ours, [ours[name].detach() for name in rule.ours])
        parts = cached[1] if rule.expert is None else [cached[1][0][rule.expert]]
        if len(parts) == 1:
            tensor = parts[0]
        else:
            tensor = torch.stack(parts, dim=-1).flatten(-2) if rule.interleave else torch.cat(parts, dim=rule.dim)
        if rule.theirs_shape is not None:
            tensor = tensor.reshape(rule.theirs_shape)
        yield rule.theirs, (_swap_last(tensor).contiguous() if rule.transpose else tensor)


def import_tensors(theirs: Mapping[str, torch.Tensor], rules: Iterable[Rule], shapes: Mapping[str, torch.Size],
                   source: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Our tensors from foreign ones, and the foreign names used (aliases count as used, unread)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    experts: dict[str, list[torch.Tensor]] = {}  # our stacked tensor -> its experts' slices, in order
    for rule in rules:
        used.add(rule.theirs)
        if rule.alias:
            continue
        if rule.theirs not in theirs:
            raise KeyError(f"{source} state dict lacks {rule.theirs!r} (needed for {', '.join(rule.ours)})")
        tensor = theirs[rule.theirs].detach()
        tensor = _swap_last(tensor) if rule.transpose else tensor
        if rule.theirs_shape is not None and tensor.numel() == shapes[rule.ours[0]].numel():
            tensor = tensor.reshape(shapes[rule.ours[0]])
        if rule.expert is not None:
            experts.setdefault(rule.ours[0], []).append(tensor)
            continue
        n = len(rule.ours)
        if rule.interleave:
            parts = tuple(tensor[..., i::n] for i in range(n))
        else:
            parts = tensor.split([shapes[name][rule.dim] for name in rule.ours], dim=rule.dim) if n > 1 else (tensor,)
        for name, piece in zip(rule.ours, parts, strict=True):
            if piece.shape != shapes[name]:
                raise ValueError(f"{source} tensor {rule.theirs!r} gives {name} the shape {tuple(piece.shape)}, "
                                 f"expected {tuple(shapes[name])}; does the config match the checkpoint?")
            out[name] = piece.contiguous()
    for name, pieces in experts.items():
        if len({p.shape for p in pieces}) > 1 or (len(pieces), *pieces[0].shape) != tuple(shapes[name]):
            raise ValueError(f"{source} experts give {name} the shape {(len(pieces), *pieces[0].shape)}, expected "
                             f"{tuple(shapes[name])}; does the config match the checkpoint?")
        out[name] = torch.stack(pieces)
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
    missing = sorted(k for k in set(shapes) - set(ours) - tied if not ZERO_ON_IMPORT.search(k))
    if missing:
        raise ValueError(f"conversion from {source} left meshformer tensors unset: {missing[:8]}")


def finish_import(out: dict[str, torch.Tensor], cfg: ModelConfig, shapes: Mapping[str, torch.Size],
                  leftovers: Iterable[str], source: str) -> dict[str, torch.Tensor]:
    """Check the names (`check_names`), restore the tied output and zero what the foreign model does not have."""
    check_names(out, cfg, shapes, leftovers, source)
    out.update({k: torch.zeros(shape) for k, shape in shapes.items() if ZERO_ON_IMPORT.search(k) and k not in out})
    if cfg.tie_embeddings and "output.weight" in shapes:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
