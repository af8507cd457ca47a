"""Does a checkpoint fit the model being trained? The key-by-key comparison behind `checkpoint.load_mode`.

A checkpoint that does not fit (a missing, unexpected or differently shaped tensor) is refused unless the user
asked for `checkpoint.load_mode="partial"`: loading only what fits silently trains a different model and then
lets retention delete the checkpoint that did fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.checkpointing.mapping import ZERO_ON_IMPORT as ROUTER_BIAS  # MoE routers' bias-balancing state
from meshformer.checkpointing.state import MODEL

Shapes = dict[str, tuple[int, ...]]  # tensor key -> global shape


@dataclass
class KeyDiff:
    """Model tensors that differ between this model and a checkpoint (names without the "model." prefix)."""

    missing: list[str] = field(default_factory=list)  # in this model, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in this model
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # checkpoint, here

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    @property
    def only_router_biases_missing(self) -> bool:
        """A checkpoint written before MoE routers' biases were saved: the runs that wrote it restarted them at zero
        at every resume, so resuming with zeros continues that run as it was."""
        return bool(self.missing) and not (self.unexpected or self.mismatched) and all(
            ROUTER_BIAS.search(k) for k in self.missing)

    @property
    def skipped(self) -> set[str]:
        """Model keys (with prefix) that a partial load leaves as initialized."""
        return {MODEL + k for k in self.missing} | {MODEL + k for k, _, _ in self.mismatched}

    def describe(self, limit: int = 4) -> str:
        def few(items: list[str]) -> str:
            return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")

        parts = []
        if self.missing:
            parts.append(f"missing from the checkpoint: {few(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected (in the checkpoint only): {few(self.unexpected)}")
        if self.mismatched:
            parts.append("with another shape (checkpoint vs here): "
                         + few([f"{k} {tuple(a)} vs {tuple(b)}" for k, a, b in self.mismatched]))
        return "; ".join(parts)


def model_shapes(tensors: dict[str, Any]) -> Shapes:
    """Global shapes of the model tensors of this rank (DTensor shapes are global)."""
    return {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(MODEL)}


def all_model_shapes(local: Shapes, group: Any = None) -> Shapes:
    """Every rank's model tensors together: a pipeline stage holds only its layers, and a key that no stage
    holds is `unexpected` only when it is missing on every rank. Collective when torch.distributed runs."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local, group=group)
    return {k: v for shapes in everyone for k, v in shapes.items()}


def compare(here: Shapes, saved: Shapes) -> KeyDiff:
    """How the model tensors here differ from the checkpoint's (only "model." keys count)."""
    saved = {k: tuple(v) for k, v in saved.items() if k.startswith(MODEL)}
    cut = len(MODEL)
    return KeyDiff(
        missing=sorted(k[cut:] for k in here if k not in saved),
        unexpected=sorted(k[cut:] for k in saved if k not in here),
        mismatched=sorted((k[cut:], saved[k], here[k]) for k in here if k in saved and saved[k] != here[k]),
    )


def refuse(path: Any, diff: KeyDiff) -> CheckpointError:
    return CheckpointError(
        f"resume refused: the tensors of {path} do not fit this model ({diff.describe()}); it was saved for a "
        "different model — restore the model.* "
        "settings it was saved with (its config.toml lists them), or set checkpoint.load_mode=\"partial\" to load "
        "only the tensors that fit and keep the rest as initialized (nothing is deleted either way)")
