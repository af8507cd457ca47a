"""Hugging Face model_type "qwen3_5_moe_text": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.qwen3_5_moe_text.hf import ADAPTER

register(ADAPTER)
