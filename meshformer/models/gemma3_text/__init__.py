"""Hugging Face model_type "gemma3_text": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.gemma3_text.hf import ADAPTER

register(ADAPTER)
