"""One package per Hugging Face architecture, named as its model_type (`llama`, `qwen3_moe`, `olmo3`, ...).

Each package's `__init__.py` registers the adapter its `hf.py` builds (checkpointing/hf_adapter.py: config both ways,
tensor names both ways, what it refuses, its size keys). The registry imports every package here on its first
lookup, so a new architecture is a new folder and nothing else; llama_like.py holds what the Llama-like ones share.
"""
