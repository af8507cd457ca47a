"""Hugging Face model_type "qwen3": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.qwen3.hf import ADAPTER

register(ADAPTER)
