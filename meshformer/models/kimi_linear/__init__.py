"""Hugging Face model_type "kimi_linear": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.kimi_linear.hf import ADAPTER

register(ADAPTER)
