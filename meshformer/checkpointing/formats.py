"""Names of the formats meshformer converts (no torch), so that `meshformer convert --help` lists them at once."""

from __future__ import annotations

from typing import Literal

Arch = Literal["gpt2", "bert", "llama", "t5", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe", "olmo2",
               "gemma2", "gemma3_text"]
ARCHS: tuple[Arch, ...] = ("gpt2", "bert", "llama", "t5", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "olmoe",
                           "olmo2", "gemma2", "gemma3_text")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
