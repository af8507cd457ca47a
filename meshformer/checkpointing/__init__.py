"""Checkpoints: resumable sharded training state (DCP), final weights, and format conversions.

    from meshformer.checkpointing import CheckpointManager      # save / resume / retention (manager.py)
    from meshformer.checkpointing import Checkpointable, TrainState  # what a save holds (train_state.py)
    from meshformer.checkpointing import read_model_source      # weights folder or checkpoint -> (cfg, state)

Conversions (safetensors_io.py, hf_folder.py + hf.py, megatron.py) are also `meshformer convert ...`.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshformer.checkpointing.checkpoint_errors import CheckpointError, ConversionError, CorruptCheckpointError
    from meshformer.checkpointing.manager import CheckpointManager
    from meshformer.checkpointing.manifest import verify_manifest
    from meshformer.checkpointing.safetensors_io import (
        checkpoint_to_safetensors,
        read_checkpoint_model,
        read_model_source,
        resolve_checkpoint,
        safetensors_to_checkpoint,
        write_weights_checkpoint,
    )
    from meshformer.checkpointing.train_state import Checkpointable, SchedulerState, Stateful, TrainState

# Imported on first use (these modules import torch): `meshformer convert --help` starts without it.
_SOURCES = {"errors": ("CheckpointError", "ConversionError", "CorruptCheckpointError"),
            "manager": ("CheckpointManager",), "manifest": ("verify_manifest",),
            "safetensors_io": ("checkpoint_to_safetensors", "read_checkpoint_model", "read_model_source",
                               "resolve_checkpoint", "safetensors_to_checkpoint", "write_weights_checkpoint"),
            "train_state": ("Checkpointable", "SchedulerState", "Stateful", "TrainState")}
_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "Checkpointable",
    "ConversionError",
    "CorruptCheckpointError",
    "SchedulerState",
    "Stateful",
    "TrainState",
    "checkpoint_to_safetensors",
    "read_checkpoint_model",
    "read_model_source",
    "resolve_checkpoint",
    "safetensors_to_checkpoint",
    "verify_manifest",
    "write_weights_checkpoint",
]
