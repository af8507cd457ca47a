"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's shape (models/deepseek_v32) with the lightning indexer rotating
interleaved pairs (our dsa.rope_interleave true) and GLM's sizes; its names are DeepSeek-V3.2's.

Refused: a block that reuses the previous block's selection (indexer_types "shared", from index_topk_freq /
index_skip_topk_offset / index_topk_pattern): each of our dsa blocks selects its own keys. Multi-token prediction as
DeepSeek-V3's; at depth 0 the published model.layers.78 is left unread.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import refuse
from meshformer.config import ModelConfig
from meshformer.models.deepseek_v32.hf import dsa_adapter, dsa_config_from_hf, dsa_config_to_hf

ARCH = "glm_moe_dsa"


def config_from_hf(c: Any) -> ModelConfig:
    shared = [i for i, kind in enumerate(c.indexer_types or []) if kind != "full"]
    if shared:
        raise refuse(ARCH, f"indexer_types[{shared[0]}]={c.indexer_types[shared[0]]!r}",
                     "reuses another block's key selection")
    return dsa_config_from_hf(c, ARCH, indexer_interleave=True)


def config_to_hf(cfg: ModelConfig) -> Any:
    return dsa_config_to_hf(cfg, "GlmMoeDsaConfig", indexer_types=["full"] * cfg.n_layers)


ADAPTER = dsa_adapter(ARCH, "GlmMoeDsaForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                      indexer_interleave=True, ignored=r"^model\.layers\.78\.")
