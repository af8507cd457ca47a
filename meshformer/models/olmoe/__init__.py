"""Hugging Face model_type "olmoe": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.olmoe.hf import ADAPTER

register(ADAPTER)
