"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's blocks (models/olmo2: post-sub-layer norms, QK-norm over the whole q / k
projection) with a sliding window on the blocks its layer_types marks "sliding_attention": every
full_attention_every-th block global, the others windowed (transformers' default: every 4th global). RoPE per layer
type, as Gemma 3: the windowed blocks' own base (rope_local_theta, unscaled), the global blocks' rope_theta with its
scaling (OLMo 3's long-context yarn). Refused: any other layer_types (e.g. an irregular list), a scaled
sliding-window RoPE, attention_bias, another activation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig
from meshformer.model.config import attention_pattern
from meshformer.models import llama_like
from meshformer.models.olmo2 import hf as olmo2


def config_from_hf(c: Any) -> ModelConfig:
    cfg = olmo2.base_config(c, "olmo3", window=False)
    kinds = list(c.layer_types)
    window = None if c.sliding_window is None or "sliding_attention" not in kinds else int(c.sliding_window)
    every = llama_like.full_attention_every(kinds, "olmo3") if window is not None else None
    return replace(cfg, attention=replace(cfg.attention, window=window), layer_types=attention_pattern(window, every),
                   rope=llama_like.rope_per_layer_type_config(c, "olmo3", window is not None))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    fields = {**olmo2.fields_to_hf(cfg), "rope_parameters": llama_like.rope_per_layer_type_to_hf(cfg)}
    return transformers.Olmo3Config(**fields, sliding_window=cfg.attention.window,
                                    layer_types=llama_like.layer_types_to_hf(cfg))


ADAPTER = llama_like.adapter(
    "olmo3", "Olmo3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    # its sliding blocks always rotate unscaled (rope_parameters.sliding_attention)
    requirements={**olmo2.REQUIREMENTS, "attention_window": ANY, "full_attention_every": ANY,
                  "rope_local_theta": ANY, "windowed_blocks_rope": "unscaled"},
    size_keys=(*llama_like.SIZE_KEYS, "sliding_window"), width_and_heads=("hidden_size", "num_attention_heads"),
)
