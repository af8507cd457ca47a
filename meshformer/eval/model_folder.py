"""The folders evaluation reads: a run (its `final/`), a weights folder (`final/`, `convert to-safetensors`) or a
Hugging Face model folder (config.json + weights + tokenizer files), as (model, tokenizer) on the CPU in fp32."""

from __future__ import annotations

from pathlib import Path

import torch

from meshformer.checkpointing.checkpoint_errors import ConversionError
from meshformer.checkpointing.weights import CONFIG_FILE, load_for_inference
from meshformer.data import Tokenizer, load_tokenizer
from meshformer.model import Transformer


def load_model_folder(path: str | Path) -> tuple[Transformer, Tokenizer]:
    """(model in eval mode, its tokenizer) of a run folder, a weights folder or a Hugging Face folder."""
    folder = Path(path)
    if (folder / "final" / CONFIG_FILE).is_file():  # a run folder: its final weights
        folder = folder / "final"
    if (folder / CONFIG_FILE).is_file():
        return load_for_inference(folder, None, "tokenizer")
    if (folder / "config.json").is_file():
        return _load_hf(folder)
    raise ConversionError(f"{folder} is neither a run folder, a weights folder ({CONFIG_FILE}) nor a Hugging Face "
                          "folder (config.json)", "point at a run's folder, its final/ folder or an exported model")


def _load_hf(folder: Path) -> tuple[Transformer, Tokenizer]:
    from meshformer.checkpointing.hf_folder import import_hf
    from meshformer.parallel.materialize import materialize

    if not (folder / "tokenizer.json").is_file():
        raise ConversionError(f"{folder} has no tokenizer.json", "save the model's tokenizer into the folder "
                              "(tokenizer.save_pretrained), as `convert to-hf` does")
    cfg, state = import_hf(folder)
    tokenizer = load_tokenizer(str(folder))
    with torch.device("meta"):
        model = Transformer(cfg)
    materialize([model], torch.device("cpu"), init=False)
    missing, unexpected = model.load_state_dict({name: state[name] for name in state}, strict=False)
    tied = {name for name in missing if name in _tied_names(model)}
    if set(missing) - tied or unexpected:
        raise ConversionError(f"cannot load {folder}: tensors missing {sorted(set(missing) - tied)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]}")
    return model.float().eval(), tokenizer


def _tied_names(model: Transformer) -> set[str]:
    """Names of parameters that share storage with another one (save_pretrained writes one of each)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied |= {name, seen[id(param)]}
        seen.setdefault(id(param), name)
    return tied
