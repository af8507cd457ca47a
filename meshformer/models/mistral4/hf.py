"""Mistral 4 (Mistral4ForCausalLM, Mistral-Small-4): DeepSeek-V3's blocks and names (models/deepseek_v3: multi-head
latent attention with low-rank queries, interleaved RoPE, YaRN's mscales, shared experts, first_k_dense_replace)
with Llama 4's query scaling and a softmax router; the routed experts are stored stacked (`rules`).

Query scaling: rope_parameters.llama_4_scaling_beta = our mla.query_scale_beta; the queries at position p are
multiplied by 1 + beta * ln(1 + floor(p / original_max_position_embeddings)) after RoPE (positions.query_scale).
rope_parameters.partial_rotary_factor is qk_rope_head_dim / (qk_nope_head_dim + qk_rope_head_dim) by construction
(transformers' head_dim is the whole query-key width) and rope_parameters.max_position_embeddings repeats the
config's; both are checked and dropped on import, written on export.

Routing: a softmax over all experts; with n_group > 1 a token keeps its topk_group groups, each scored by the sum of
its best two experts (= our router_group_score "top2_sum"); the top-k weights renormalised when norm_topk_prob and
multiplied by routed_scaling_factor (= our router_scale). No selection bias (e_score_correction_bias), no
multi-token prediction layers.

Refused: attention_bias, num_key_value_heads other than num_attention_heads, a rotary split other than
qk_rope_head_dim, another hidden_act, FP8-block scales (weight_scale_inv) outside a quant_method fp8 folder (which
is read dequantized). Export requires YaRN
(transformers' query scaling reads original_max_position_embeddings, which only scaled RoPE carries).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, refuse
from meshformer.config import ModelConfig
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.deepseek_v3.hf import FP8, mla_config_from_hf, mla_fields_to_hf, mla_rules

ARCH = "mistral4"


class _ConfigView:
    """The config as DeepSeek's field mapping reads it: rope_parameters without Mistral 4's own keys."""

    def __init__(self, c: Any, rope: dict[str, Any]) -> None:
        self._c, self.rope_parameters = c, rope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def config_from_hf(c: Any) -> ModelConfig:
    rope = dict(c.rope_parameters or {})
    beta = rope.pop("llama_4_scaling_beta", None) or 0.0
    rope.pop("max_position_embeddings", None)  # a copy of the config's, which transformers' YaRN does not read
    rotary = c.qk_rope_head_dim / (c.qk_nope_head_dim + c.qk_rope_head_dim)
    partial = rope.pop("partial_rotary_factor", rotary)
    if not math.isclose(partial, rotary):
        raise refuse(ARCH, f"rope_parameters.partial_rotary_factor={partial}", f"rotates other than the "
                     f"qk_rope_head_dim={c.qk_rope_head_dim} columns of each {c.qk_nope_head_dim + c.qk_rope_head_dim}"
                     "-wide query and key head")
    cfg = mla_config_from_hf(_ConfigView(c, rope), ARCH, router_score="softmax",
                             router_renormalize=bool(c.norm_topk_prob), router_groups=c.n_group or 1,
                             router_groups_per_token=c.topk_group or 1, router_group_score="top2_sum")
    return replace(cfg, mla=replace(cfg.mla, query_scale_beta=float(beta)))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    fields = mla_fields_to_hf(cfg)
    m = cfg.mla
    fields["rope_parameters"].update(llama_4_scaling_beta=m.query_scale_beta, max_position_embeddings=cfg.max_seq_len,
                                     partial_rotary_factor=m.qk_rope_head_dim / m.qk_head_dim)
    return transformers.Mistral4Config(
        **fields, rope_interleave=m.rope_interleave,
        norm_topk_prob=cfg.moe.router_renormalize, n_group=cfg.moe.router_groups,
        topk_group=cfg.moe.router_groups_per_token)


def rules(cfg: ModelConfig) -> list[Rule]:
    """DeepSeek-V3's names without the selection bias or multi-token prediction layers, the routed experts stored
    stacked as transformers keeps them, (out, in): gate_up_proj (E, 2 x moe_d_ff, d) holds every expert's gate rows
    then its up rows, down_proj (E, d, moe_d_ff)."""
    out = [r for r in mla_rules(cfg, selection_bias=False) if ".mlp.experts." not in r.theirs]
    for i in range(cfg.n_layers):
        if cfg.is_moe(i):
            ours, theirs = f"decoder_layers.{i}.ffn.experts", f"model.layers.{i}.mlp.experts"
            out += [Rule((f"{ours}.gate_proj", f"{ours}.up_proj"), f"{theirs}.gate_up_proj", transpose=True, dim=-1),
                    Rule((f"{ours}.down_proj",), f"{theirs}.down_proj", transpose=True)]
    return out


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """No multi-token prediction modules (Mistral 4 has none)."""
    return {"mtp_depth": cfg.mtp.depth}


ADAPTER = replace(llama_like.adapter(
    ARCH, "Mistral4ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "mla"),
    expresses=("mla.query_scale_beta",),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "mla": True, "moe": True, "n_shared_experts": ANY,
                  "router_score": "softmax", "router_renormalize": {True, False}, "router_groups": ANY,
                  "router_scale": ANY, "moe_blocks": {"every block", "some"}, "grouped_query": False,
                  "head_dim": ANY, "rope_scaling": "yarn", "mtp_depth": 0},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    refused_names=(FP8,),
), rules=rules)
