"""Hugging Face model_type "qwen3_next": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.qwen3_next.hf import ADAPTER

register(ADAPTER)
