"""Hugging Face model_type "deepseek_v4": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.deepseek_v4.hf import ADAPTER

register(ADAPTER)
