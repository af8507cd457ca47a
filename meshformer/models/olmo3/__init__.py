"""Hugging Face model_type "olmo3": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.olmo3.hf import ADAPTER

register(ADAPTER)
