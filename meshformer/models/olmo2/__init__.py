"""Hugging Face model_type "olmo2": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.olmo2.hf import ADAPTER

register(ADAPTER)
