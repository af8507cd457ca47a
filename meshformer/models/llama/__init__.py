"""Hugging Face model_type "llama": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.llama.hf import ADAPTER

register(ADAPTER)
