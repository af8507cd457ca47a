"""Errors of the checkpointing package: each message says what is wrong and how to fix it."""

from __future__ import annotations

from meshformer.errors import MeshformerError


class CheckpointError(MeshformerError, RuntimeError):
    """A checkpoint that cannot be written, found, verified or loaded."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint folder whose files do not match its manifest (or that has no manifest)."""


class ConversionError(CheckpointError):
    """A conversion between formats that cannot be done as asked (e.g. mismatched architectures)."""
