"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 (models/deepseek_v3) whose every block attends through
DeepSeek Sparse Attention (our layer_types ["dsa"], [model.mla] and [model.dsa]).

Attention (model.layers.{i}.self_attn.) as DeepSeek-V3's with low-rank queries (always: q_lora_rank) and interleaved
rotary pairs (always), plus the lightning indexer self_attn.indexer.: wq_b (from the query latent), wk, k_norm (a
LayerNorm with bias), weights_proj = ours of the same names. index_n_heads, index_head_dim, index_topk = our
dsa.n_heads, dsa.head_dim, dsa.topk; the indexer rotates half-split pairs (dsa.rope_interleave false).
mlp_layer_types must be first_k_dense_replace dense blocks, then MoE blocks (= our moe_first_dense).

Multi-token prediction as DeepSeek-V3's: our module k is their layer num_hidden_layers + k (its block's indexer
included), read and written with model.mtp.depth > 0; at depth 0 the published model.layers.61 is left unread.

`dsa_adapter` builds the adapter of an architecture of this shape (GLM-5's, models/glm_moe_dsa, reuses it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, HFAdapter, refuse
from meshformer.config import ModelConfig
from meshformer.model.config import DsaConfig
from meshformer.model.families.naming import Rule, params
from meshformer.models import llama_like
from meshformer.models.deepseek_v3 import hf as deepseek_v3

ARCH = "deepseek_v32"
INDEXER_LINEARS = ("wq_b", "wk", "weights_proj")
SIZE_KEYS = ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank")


def dsa_config_from_hf(c: Any, arch: str, indexer_interleave: bool,
                       layer_types: list[str] | None = None) -> ModelConfig:
    """DeepSeek-V3's fields with every block a dsa block (or as `layer_types` says) and its indexer's sizes."""
    n_dense = min(c.first_k_dense_replace or 0, c.num_hidden_layers)
    expected = ["dense"] * n_dense + ["sparse"] * (c.num_hidden_layers - n_dense)
    if c.mlp_layer_types is not None and list(c.mlp_layer_types) != expected:
        raise refuse(arch, f"mlp_layer_types={c.mlp_layer_types}", f"is not {n_dense} dense blocks, then MoE ones")
    cfg = deepseek_v3.mla_config_from_hf(c, arch, router_score="sigmoid", router_renormalize=bool(c.norm_topk_prob),
                                         router_groups=c.n_group or 1, router_groups_per_token=c.topk_group or 1)
    return replace(cfg, layer_types=layer_types or ["dsa"], mla=replace(cfg.mla, rope_interleave=True),
                   dsa=DsaConfig(n_heads=c.index_n_heads, head_dim=c.index_head_dim, topk=c.index_topk,
                                 rope_interleave=indexer_interleave))


def dsa_config_to_hf(cfg: ModelConfig, config_class: str, **extra: Any) -> Any:
    import transformers

    fields = deepseek_v3.mla_fields_to_hf(cfg)
    if cfg.mtp.depth:
        fields["num_nextn_predict_layers"] = cfg.mtp.depth
    return getattr(transformers, config_class)(
        **fields, norm_topk_prob=cfg.moe.router_renormalize, n_group=cfg.moe.router_groups,
        topk_group=cfg.moe.router_groups_per_token, index_n_heads=cfg.dsa.n_heads, index_head_dim=cfg.dsa.head_dim,
        index_topk=cfg.dsa.topk, **extra)


def dsa_rules(cfg: ModelConfig) -> list[Rule]:
    """DeepSeek-V3's names (MLA, router selection bias, shared experts), each block's indexer, and the multi-token
    prediction layers."""
    out = deepseek_v3.mla_rules(cfg, selection_bias=True)
    for i in range(cfg.n_layers):
        if cfg.layer_type(i) != "dsa":  # a dsa_shared block (GLM-5) holds no indexer
            continue
        o, t = f"decoder_layers.{i}.attn.indexer", f"model.layers.{i}.self_attn.indexer"
        for name in INDEXER_LINEARS:
            out += params(f"{o}.{name}", f"{t}.{name}", ("weight",))
        out += params(f"{o}.k_norm", f"{t}.k_norm", ("weight", "bias"))
    return out + deepseek_v3.mtp_rules(cfg, out)


def dsa_features(cfg: ModelConfig) -> dict[str, Any]:
    """The rotary layouts: interleaved pairs in the attention, the indexer's as the architecture has them; whether
    some blocks reuse an earlier block's key selection (GLM-5's indexer_types "shared")."""
    return {"mla_rope_interleave": cfg.mla.rope_interleave, "indexer_rope_interleave": cfg.dsa.rope_interleave,
            "indexer_shared": "dsa_shared" in cfg.layer_types}


def dsa_adapter(arch: str, model_class: str, *, config_from_hf: Any, config_to_hf: Any, indexer_interleave: bool,
                ignored: str, indexer_shared: Any = False) -> HFAdapter:
    return replace(llama_like.adapter(
        arch, model_class, config_from_hf=config_from_hf, config_to_hf=config_to_hf,
        kinds=(*PLAIN_KINDS, "dsa", *(("dsa_shared",) if indexer_shared is not False else ())),
        requirements={**deepseek_v3.ADAPTER.requirements, "dsa": True, "mla_rope_interleave": True,
                      "indexer_rope_interleave": indexer_interleave, "indexer_shared": indexer_shared,
                      "n_shared_experts": ANY},
        extra_features=dsa_features,
        size_keys=(*deepseek_v3.ADAPTER.size_keys, *SIZE_KEYS), refused_names=(deepseek_v3.FP8,), ignored=ignored,
        holds_selection_bias=True,
    ), rules=dsa_rules, hf_layer_types=("indexed_attention",))


def config_from_hf(c: Any) -> ModelConfig:
    return dsa_config_from_hf(c, ARCH, indexer_interleave=False)


def config_to_hf(cfg: ModelConfig) -> Any:
    return dsa_config_to_hf(cfg, "DeepseekV32Config")


ADAPTER = dsa_adapter(ARCH, "DeepseekV32ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
                      indexer_interleave=False, ignored=r"^model\.layers\.61\.")
