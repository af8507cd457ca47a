"""The folders evaluation reads, with no export step: a run folder (its `final/`, else its newest committed
checkpoint), a weights folder (`final/`, `convert to-safetensors`), a sharded checkpoint (a step folder, or a
checkpoints folder: its newest committed step) or a Hugging Face model folder (config.json + weights + tokenizer
files). `open_model_folder` gives the model config, its tensors under meshformer's names (read as `weights.load_into`
reads them: a sharded model takes only its slices) and the tokenizer; `load_model_folder` builds the whole model
from them on the CPU in fp32."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshformer.checkpointing import directory
from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.manifest import MANIFEST
from meshformer.checkpointing.weights import CONFIG_FILE, TensorSource, load_for_inference, load_into
from meshformer.config import ModelConfig
from meshformer.data import Tokenizer, load_tokenizer
from meshformer.model import Transformer

RUN_CHECKPOINTS = "checkpoints"  # where a run keeps its checkpoints (checkpoint.dir left at its default)


@dataclass
class ModelFolder:
    """A folder's model: its kind ("weights", "checkpoint" or "hf"), the folder read, config, tensors, tokenizer."""

    kind: str
    path: Path
    cfg: ModelConfig
    tensors: TensorSource
    tokenizer: Tokenizer


class _MappedTensors:
    """A name -> tensor mapping (a checkpoint's, read on access) as `load_into` reads it: slices of a whole tensor;
    the output projection is the embedding where the model ties them and the mapping holds one copy."""

    def __init__(self, state: Mapping[str, torch.Tensor], tied: bool) -> None:
        self.state, self.tied = state, tied

    def _name(self, name: str) -> str:
        return "tok_embeddings.weight" if self.tied and name == "output.weight" and name not in self.state else name

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.state

    def get(self, name: str) -> torch.Tensor:
        return self.state[self._name(name)]

    def get_slice(self, name: str) -> Any:
        return self.get(name)


def resolve_folder(path: str | Path) -> tuple[str, Path]:
    """(kind, folder to read) of what `meshformer eval` is pointed at; one line naming the kinds otherwise."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder", "point at a run folder, its final/, a checkpoint or an "
                              "exported model")
    if (folder / "final" / CONFIG_FILE).is_file():  # a run folder: its final weights
        return "weights", folder / "final"
    if (folder / CONFIG_FILE).is_file():
        return "weights", folder
    if (folder / MANIFEST).is_file():  # a committed step folder of a sharded checkpoint
        return "checkpoint", folder
    for root in (folder / RUN_CHECKPOINTS, folder):  # a run without final/ yet, or its checkpoints folder
        if steps := directory.committed_steps(root):
            return "checkpoint", root / directory.step_dir_name(steps[-1])
    if (folder / "config.json").is_file():
        return "hf", folder
    raise ConversionError(f"{folder} is neither a run folder (final/ or committed checkpoints), a weights folder "
                          f"({CONFIG_FILE}), a checkpoint (step-N/ with {MANIFEST}) nor a Hugging Face folder "
                          "(config.json)", "point at a run's folder, its final/ or checkpoints/ folder, a step "
                          "folder or an exported model")


def open_model_folder(path: str | Path) -> ModelFolder:
    """The config, tensors (read on access) and tokenizer of any folder `resolve_folder` accepts."""
    kind, folder = resolve_folder(path)
    if kind == "weights":
        from meshformer.checkpointing.safetensors_io import lazy_weights
        from meshformer.checkpointing.weights import weights_tokenizer

        tokenizer = weights_tokenizer(folder, None, "tokenizer")
        cfg, weights = lazy_weights(folder)
        return ModelFolder(kind, folder, cfg, _MappedTensors(weights, False), tokenizer)
    if kind == "checkpoint":
        from meshformer.checkpointing.safetensors_io import read_checkpoint_model

        if not (folder / directory.TOKENIZER_FILE).is_file():
            raise ConversionError(f"{folder} carries no {directory.TOKENIZER_FILE} (a checkpoint of an older run)",
                                  "convert it with `meshformer convert to-safetensors SRC OUT --tokenizer SPEC` and "
                                  "evaluate OUT")
        cfg, state = read_checkpoint_model(folder)
        return ModelFolder(kind, folder, cfg, _MappedTensors(state, cfg.tie_embeddings),
                           load_tokenizer(str(folder / directory.TOKENIZER_FILE)))
    from meshformer.checkpointing.init_from import HFInitWeights

    if not (folder / "tokenizer.json").is_file():
        raise ConversionError(f"{folder} has no tokenizer.json", "save the model's tokenizer into the folder "
                              "(tokenizer.save_pretrained), as `convert to-hf` does")
    source = HFInitWeights(folder)
    return ModelFolder(kind, folder, source.cfg, source, load_tokenizer(str(folder)))


def load_model_folder(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode on the CPU in fp32, its tokenizer) of any folder `resolve_folder` accepts."""
    kind, folder = resolve_folder(path)
    if kind == "weights":
        return load_for_inference(folder, None, "tokenizer")
    from meshformer.parallel.materialize import materialize

    opened = open_model_folder(folder)
    with torch.device("meta"):
        model = Transformer(opened.cfg)
    materialize([model], torch.device("cpu"), init=False)
    load_into([model], opened.tensors)  # fp32, whatever dtype was saved
    return model.float().eval(), opened.tokenizer
