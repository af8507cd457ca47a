"""GLM-5 (GlmMoeDsaForCausalLM): DeepSeek-V3.2's shape (models/deepseek_v32) with the lightning indexer rotating
interleaved pairs (our dsa.rope_interleave true) and GLM's sizes; its names are DeepSeek-V3.2's.

indexer_types (set, or derived from index_topk_freq / index_skip_topk_offset / index_topk_pattern) = our layer_types:
"full" a dsa block, "shared" a dsa_shared block, which holds no indexer and attends to the keys of the nearest earlier
full block. Multi-token prediction as DeepSeek-V3's; at depth 0 the published model.layers.78 is left unread.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, refuse
from meshformer.config import ModelConfig
from meshformer.models.deepseek_v32.hf import dsa_adapter, dsa_config_from_hf, dsa_config_to_hf

ARCH = "glm_moe_dsa"


KINDS = {"full": "dsa", "shared": "dsa_shared"}


def config_from_hf(c: Any) -> ModelConfig:
    types = list(c.indexer_types or ["full"])
    if bad := [i for i, kind in enumerate(types) if kind not in KINDS]:
        raise refuse(ARCH, f"indexer_types[{bad[0]}]={types[bad[0]]!r}", "is neither 'full' nor 'shared'")
    if types[0] != "full":
        raise refuse(ARCH, f"indexer_types[0]={types[0]!r}", "has no earlier block's key selection to reuse")
    kinds = [KINDS[kind] for kind in types]
    return dsa_config_from_hf(c, ARCH, indexer_interleave=True, layer_types=kinds if "dsa_shared" in kinds else None)


def config_to_hf(cfg: ModelConfig) -> Any:
    types = ["shared" if cfg.layer_type(i) == "dsa_shared" else "full" for i in range(cfg.n_layers)]
    return dsa_config_to_hf(cfg, "GlmMoeDsaConfig", indexer_types=types)


ADAPTER = dsa_adapter(ARCH, "GlmMoeDsaForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                      indexer_interleave=True, ignored=r"^model\.layers\.78\.", indexer_shared=ANY)
