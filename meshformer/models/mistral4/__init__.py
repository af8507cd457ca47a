"""Hugging Face model_type "mistral4": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.mistral4.hf import ADAPTER

register(ADAPTER)
