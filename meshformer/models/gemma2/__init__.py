"""Hugging Face model_type "gemma2": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.gemma2.hf import ADAPTER

register(ADAPTER)
