"""Hugging Face model_type "mistral": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.mistral.hf import ADAPTER

register(ADAPTER)
