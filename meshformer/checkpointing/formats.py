"""Names of the formats meshformer converts (no torch), so that `meshformer convert --help` lists them at once."""

from __future__ import annotations

import importlib.util
import pkgutil

# One package per Hugging Face architecture, named as its model_type (checkpointing/hf_adapter.py registers them)
MODELS_PACKAGE = "meshformer.models"

Arch = str  # a Hugging Face model_type with a folder under meshformer/models/


def hf_archs() -> tuple[str, ...]:
    """The model_types meshformer converts: the folders of meshformer/models/, listed without importing them."""
    spec = importlib.util.find_spec(MODELS_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return tuple(sorted(m.name for m in pkgutil.iter_modules(locations) if m.ispkg))


ARCHS: tuple[Arch, ...] = hf_archs()

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
