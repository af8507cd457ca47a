"""Qwen3.5-MoE's language model (Qwen3_5MoeForCausalLM, model_type "qwen3_5_moe_text"): Qwen3.5's blocks
(meshformer/models/qwen3_5_text/hf.py: split Gated DeltaNet projections, multimodal RoPE that rotates text as plain
RoPE) with Qwen3-Next's MoE feed-forward in every block: top-k of a softmax over all experts, always renormalised,
beside one shared expert of shared_expert_intermediate_size = our n_shared_experts x moe_d_ff gated by
sigmoid(mlp.shared_expert_gate). Its config has no dense width; our unused ffn.d_ff is set to moe_intermediate_size.
mtp.* and a multimodal checkpoint's vision tower are left unread.

Refused: attention_bias, a shared expert width that is not a multiple of moe_intermediate_size, another
hidden_act, rotary scaling other than ours.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, HFAdapter
from meshformer.config import ModelConfig
from meshformer.model.families.naming import Rule
from meshformer.models import qwen3_5_text
from meshformer.models.qwen3_next.hf import (
    EXPERTS,
    hybrid_from_hf,
    hybrid_rules,
    hybrid_to_hf,
    moe_from_hf,
    shared_expert_rules,
)

ARCH = "qwen3_5_moe_text"


class _WithDenseWidth:
    """A config read as if its intermediate_size were moe_intermediate_size (it has no dense width)."""

    def __init__(self, config: Any) -> None:
        self._config, self.intermediate_size = config, config.moe_intermediate_size

    def __getattr__(self, key: str) -> Any:
        return getattr(self._config, key)


def config_from_hf(c: Any) -> ModelConfig:
    cfg = hybrid_from_hf(_WithDenseWidth(c), ARCH, drop_rope_keys=qwen3_5_text.hf.MROPE_KEYS,
                         moe=moe_from_hf(c, ARCH, router_renormalize=True))
    cfg.linear_attention.projections = "split"
    return cfg


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    fields = hybrid_to_hf(cfg)
    del fields["intermediate_size"]
    return transformers.Qwen3_5MoeTextConfig(
        **fields, num_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        moe_intermediate_size=cfg.expert_d_ff, shared_expert_intermediate_size=cfg.moe.n_shared_experts *
        cfg.expert_d_ff, router_aux_loss_coef=cfg.moe.aux_loss)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Qwen3.5's names with Qwen3-Next's experts, shared expert and its gate."""
    return hybrid_rules(cfg, EXPERTS, qwen3_5_text.hf.LINEAR_PARAMS) + shared_expert_rules(cfg)


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Split Gated DeltaNet projections; every block's experts beside one gated shared expert."""
    return {**qwen3_5_text.hf.extra_features(cfg),
            "gated_shared_expert": cfg.moe.n_shared_experts > 0 and cfg.moe.shared_expert_gate}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="Qwen3_5MoeForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "linear_attention"),
    rules=rules, base_prefix="model.", layer_keys=("num_hidden_layers",),
    hf_layer_types=("linear_attention", "full_attention"),
    requirements={**qwen3_5_text.hf.ADAPTER.requirements, "moe": True, "n_shared_experts": ANY,
                  "shared_expert_gate": True, "gated_shared_expert": True, "router_renormalize": True,
                  "moe_blocks": "every block"},
    extra_features=extra_features,
    size_keys=tuple(k for k in qwen3_5_text.hf.ADAPTER.size_keys if k != "intermediate_size"),
    ignored=qwen3_5_text.hf.ADAPTER.ignored, old_names=qwen3_5_text.hf.ADAPTER.old_names,
)
