"""Hugging Face model_type "mixtral": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.mixtral.hf import ADAPTER

register(ADAPTER)
