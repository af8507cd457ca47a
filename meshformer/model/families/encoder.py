"""Encoder-only (BERT): one bidirectional stack; masked-token prediction.

Name map: Hugging Face BERT's lives in meshformer/models/bert/.
"""

from __future__ import annotations

from meshformer.model.families.common import transformer_family
from meshformer.model.families.spec import Stack
from meshformer.model.flops import encoder_flops

SPEC = transformer_family(
    name="encoder",
    stacks=(Stack("encoder", causal=False, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("mlm",),
    training_flops=encoder_flops,
    name_maps={},  # Hugging Face BERT's: meshformer/models/bert/
)
