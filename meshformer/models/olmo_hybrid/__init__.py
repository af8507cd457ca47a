"""Hugging Face model_type "olmo_hybrid": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.olmo_hybrid.hf import ADAPTER

register(ADAPTER)
