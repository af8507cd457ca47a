"""Hugging Face model_type "nemotron_h": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.nemotron_h.hf import ADAPTER

register(ADAPTER)
