"""Hugging Face model_type "t5": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.t5.hf import ADAPTER

register(ADAPTER)
