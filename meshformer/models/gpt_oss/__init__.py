"""Hugging Face model_type "gpt_oss": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.gpt_oss.hf import ADAPTER

register(ADAPTER)
