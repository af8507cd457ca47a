"""Evaluation through lm-evaluation-harness' own engine: `MeshformerLM` (lm.py) is an lm-eval `LM` over a meshformer
model and the tokenizer it was trained with, registered with lm-eval as `meshformer`; load.py opens the folders it
evaluates."""
