"""Hugging Face model_type "glm4_moe": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.glm4_moe.hf import ADAPTER

register(ADAPTER)
