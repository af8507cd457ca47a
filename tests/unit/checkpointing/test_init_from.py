"""checkpoint.init_from merging the folder's model config with the run's [model] keys (checkpointing/init_from.py)."""

from __future__ import annotations

import dataclasses

import pytest

from meshformer.checkpointing.init_from import _merge
from meshformer.config import ModelConfig
from meshformer.errors import ConfigError
from meshformer.model.config import NormConfig


def test_a_resolved_model_config_merges_again_unchanged():
    """A config already resolved from a folder (as the launcher passes it to the trainer, which resolves again) whose
    free-key table (norm.by_kind) the default config lacks keeps every key; a key set against it is still refused."""
    source = ModelConfig(layer_types=["linear_attention", "full_attention"],
                         norm=NormConfig(kind="rmsnorm", position="post_sublayer", by_kind={"linear_attention": "pre"}))
    assert _merge(source, source, "hf:folder") == source
    other = dataclasses.replace(source, norm=dataclasses.replace(source.norm, by_kind={"full_attention": "pre"}))
    with pytest.raises(ConfigError, match=r"model\.norm\.by_kind\.full_attention='pre' \(it has None\)"):
        _merge(source, other, "hf:folder")
