"""Checkpoints: resumable sharded training state (DCP), final weights, and format conversions.

    from meshformer.checkpointing import CheckpointManager      # save / resume / retention (manager.py)
    from meshformer.checkpointing import Checkpointable, TrainState  # what a save holds (train_state.py)
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
from meshformer.checkpointing.train_state import Checkpointable, SchedulerState, Stateful, TrainState

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
