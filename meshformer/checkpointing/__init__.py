"""Checkpoints: resumable sharded training state (DCP), final weights, and format conversions.

    from meshformer.checkpointing import CheckpointManager      # save / resume / retention (manager.py)
    from meshformer.checkpointing import read_model_source      # weights folder or checkpoint -> (cfg, state)

Conversions (safetensors_io.py, hf_folder.py + hf.py, megatron.py) are also `meshformer convert ...`.
"""

from meshformer.checkpointing.errors import CheckpointError, ConversionError, CorruptCheckpointError
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

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "ConversionError",
    "CorruptCheckpointError",
    "checkpoint_to_safetensors",
    "read_checkpoint_model",
    "read_model_source",
    "resolve_checkpoint",
    "safetensors_to_checkpoint",
    "verify_manifest",
    "write_weights_checkpoint",
]
