"""Hugging Face model_type "bert": its adapter (hf.py), registered for the conversion code to find."""

from meshformer.checkpointing.hf_adapter import register
from meshformer.models.bert.hf import ADAPTER

register(ADAPTER)
