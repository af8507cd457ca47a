"""Hugging Face model_type "deepseek_v2": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.deepseek_v2.hf import ADAPTER

register(ADAPTER)
