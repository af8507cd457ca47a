"""Hugging Face model_type "glm_moe_dsa": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.glm_moe_dsa.hf import ADAPTER

register(ADAPTER)
