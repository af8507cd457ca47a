"""DeepSeek-V3 (DeepseekV3ForCausalLM; also Kimi K2): Llama's pre-norm blocks and names with multi-head latent attention
in every block (our layer_types ["mla"], [model.mla]) and DeepSeek's mixture of experts after the first dense blocks.

Attention (model.layers.{i}.self_attn.): q_proj, or q_a_proj / q_a_layernorm / q_b_proj with q_lora_rank = our
q_proj, or q_a_proj / q_a_norm / q_b_proj; kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj = our kv_a_proj /
kv_a_norm / kv_b_proj; o_proj. kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave = ours.
YaRN's mscale / mscale_all_dim: the cos/sin factor mscale(factor, mscale) / mscale(factor, mscale_all_dim) = our
rope.attention_factor, and the scores' mscale(factor, mscale_all_dim)^2 = our mla.mscale_all_dim.

Experts: the router mlp.gate (sigmoid scores; its e_score_correction_bias = our router.expert_bias, the
auxiliary-loss-free selection bias), n_group / topk_group = our router_groups / router_groups_per_token,
norm_topk_prob = router_renormalize, routed_scaling_factor = router_scale; experts mlp.experts.{j}.gate_proj /
up_proj / down_proj of width moe_intermediate_size; mlp.shared_experts (n_shared_experts of that width, as one
FFN = ours). first_k_dense_replace = our moe_first_dense, those blocks' MLP intermediate_size wide.

Refused: attention_bias, num_key_value_heads other than num_attention_heads (transformers repeats keys that
already have every head). A folder stored in FP8 blocks (weight_scale_inv, quant_method fp8) is read dequantized
(checkpointing/quantized.py); scales without that quantization_config are refused.

Multi-token prediction: with model.mtp.depth > 0 our module k is their layer num_hidden_layers + k (enorm, hnorm,
eh_proj, shared_head.norm and a decoder layer of the last layer's kinds; its embed_tokens and shared_head.head are
the shared embedding and output head), read on import and written on export (num_nextn_predict_layers = depth).
An import builds depth 0 unless model.mtp.depth is set (transformers' configs name num_nextn_predict_layers whether
or not the files hold those tensors); at depth 0 the published checkpoints' model.layers.61 is ignored (transformers
skips it too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, refuse
from meshformer.config import MlaConfig, ModelConfig, MoeConfig
from meshformer.model.config import moe_pattern
from meshformer.model.families.naming import Rule, params
from meshformer.model.mla import yarn_mscale
from meshformer.models import llama_like
from meshformer.models.qwen3_moe.hf import EXPERTS

ARCH = "deepseek_v3"
FP8 = (r"weight_scale_inv$", "the weights are stored in FP8 blocks with scales, which meshformer dequantizes only "
       "from a folder whose config.json names them; add quantization_config {\"quant_method\": \"fp8\", "
       "\"weight_block_size\": [128, 128]} to config.json and import the folder")
# our MLA linears -> theirs: the query path (direct, or low-rank with its norm), then keys / values and output
_DIRECT_QUERIES = {"q_proj": "q_proj"}
_LOW_RANK_QUERIES = {"q_a_proj": "q_a_proj", "q_b_proj": "q_b_proj"}
_KV_AND_OUTPUT = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_b_proj": "kv_b_proj", "o_proj": "o_proj"}


class _RopeView:
    """The config as llama_like reads it: rope_parameters without DeepSeek's mscale keys (handled here)."""

    def __init__(self, c: Any, rope: dict[str, Any]) -> None:
        self._c, self.rope_parameters = c, rope

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def mla_config_from_hf(c: Any, arch: str, **router: Any) -> ModelConfig:
    """What DeepSeek-V2 and V3 give the same way: Llama's, MLA's, YaRN's mscales, the experts' sizes, the shared
    experts and the dense first blocks; `router`: the caller's [model.moe] router keys."""
    llama_like.refuse_attention_bias(c, arch)
    if c.num_key_value_heads not in (None, c.num_attention_heads):
        raise refuse(arch, f"num_key_value_heads={c.num_key_value_heads}", "differs from num_attention_heads="
                     f"{c.num_attention_heads} (transformers then repeats keys that already have every head)")
    rope = dict(c.rope_parameters or {})
    mscale, mscale_all_dim = rope.pop("mscale", None), rope.pop("mscale_all_dim", None)
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("attention_factor") is None \
            and mscale and mscale_all_dim:
        rope["attention_factor"] = yarn_mscale(rope["factor"], mscale) / yarn_mscale(rope["factor"], mscale_all_dim)
    cfg = llama_like.config_from_hf(_RopeView(c, rope), arch)
    mla = MlaConfig(q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                    rope_interleave=bool(getattr(c, "rope_interleave", True)),
                    mscale_all_dim=float(mscale_all_dim or 0.0))
    experts = c.n_routed_experts
    return replace(
        cfg, layer_types=["mla"], attention=replace(cfg.attention, head_dim=None, n_kv_heads=None), mla=mla,
        mlp_types=moe_pattern(1, c.first_k_dense_replace or 0, cfg.n_layers) if experts else [],
        moe=MoeConfig(n_experts=experts, experts_per_token=c.num_experts_per_tok, d_ff=c.moe_intermediate_size,
                      n_shared_experts=c.n_shared_experts or 0, router_scale=float(c.routed_scaling_factor), **router))


def config_from_hf(c: Any) -> ModelConfig:
    return mla_config_from_hf(c, ARCH, router_score="sigmoid", router_renormalize=bool(c.norm_topk_prob),
                              router_groups=c.n_group or 1, router_groups_per_token=c.topk_group or 1)


def mla_fields_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config arguments DeepSeek-V2 and V3 take the same way (each adds its router's)."""
    fields = llama_like.fields_to_hf(cfg)
    del fields["head_dim"]  # transformers sets it to qk_rope_head_dim
    rope, m = fields["rope_parameters"], cfg.mla
    if m.mscale_all_dim:
        rope["mscale_all_dim"] = m.mscale_all_dim
        if rope.get("attention_factor") == 1.0:  # as published: equal mscales, whose ratio is 1
            del rope["attention_factor"]
            rope["mscale"] = m.mscale_all_dim
    first_dense = next((i for i in range(cfg.n_layers) if cfg.is_moe(i)), cfg.n_layers)
    return dict(
        **fields, intermediate_size=cfg.ffn.d_ff, moe_intermediate_size=cfg.expert_d_ff,
        q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, n_routed_experts=cfg.moe.n_experts,
        num_experts_per_tok=cfg.moe.experts_per_token, n_shared_experts=cfg.moe.n_shared_experts,
        routed_scaling_factor=cfg.moe.router_scale, first_k_dense_replace=first_dense, attention_bias=False)


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.DeepseekV3Config(
        **mla_fields_to_hf(cfg), rope_interleave=cfg.mla.rope_interleave, norm_topk_prob=cfg.moe.router_renormalize,
        n_group=cfg.moe.router_groups, topk_group=cfg.moe.router_groups_per_token,
        num_nextn_predict_layers=cfg.mtp.depth)  # type: ignore[call-arg]  # an attribute_map alias


def mla_rules(cfg: ModelConfig, selection_bias: bool) -> list[Rule]:
    """Llama's names for embeddings, norms and MLPs, with MLA's projections and the shared experts (and, with
    `selection_bias`, the routers' e_score_correction_bias)."""
    out = [r for r in llama_like.rules(cfg, EXPERTS) if not any(".attn." in name for name in r.ours)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}.attn", f"model.layers.{i}.self_attn"
        low_rank = cfg.mla.q_lora_rank is not None
        for ours, theirs in {**(_LOW_RANK_QUERIES if low_rank else _DIRECT_QUERIES), **_KV_AND_OUTPUT}.items():
            out += params(f"{o}.{ours}", f"{t}.{theirs}", ("weight",))
        out += [Rule((f"{o}.kv_a_norm.weight",), f"{t}.kv_a_layernorm.weight")]
        if low_rank:
            out += [Rule((f"{o}.q_a_norm.weight",), f"{t}.q_a_layernorm.weight")]
    return out + shared_expert_rules(cfg, selection_bias)


def rules(cfg: ModelConfig) -> list[Rule]:
    """MLA's names with the router's selection bias, and the multi-token prediction layers."""
    out = mla_rules(cfg, selection_bias=True)
    return out + mtp_rules(cfg, out)


def shared_expert_rules(cfg: ModelConfig, selection_bias: bool) -> list[Rule]:
    """Each MoE block's shared experts (one FFN) and, with `selection_bias`, its router's
    e_score_correction_bias = our router.expert_bias."""
    out: list[Rule] = []
    for i in range(cfg.n_layers):
        if cfg.is_moe(i):
            f, m = f"decoder_layers.{i}.ffn", f"model.layers.{i}.mlp"
            if selection_bias:
                out.append(Rule((f"{f}.router.expert_bias",), f"{m}.gate.e_score_correction_bias"))
            if cfg.moe.n_shared_experts:
                for p in ("gate", "up", "down"):
                    out += params(f"{f}.shared_experts.{p}_proj", f"{m}.shared_experts.{p}_proj", ("weight",))
    return out


def mtp_rules(cfg: ModelConfig, main: list[Rule]) -> list[Rule]:
    """Multi-token prediction module k (from 0) as DeepSeek's layer num_hidden_layers + k: enorm, hnorm, eh_proj,
    shared_head.norm, the decoder layer's tensors named as the last main layer's (its kinds), and copies of the shared
    embedding and output head (aliases: written on export, not read)."""
    last = cfg.n_layers - 1
    ours_prefix, theirs_prefix = f"decoder_layers.{last}.", f"model.layers.{last}."
    block = [r for r in main if r.theirs.startswith(theirs_prefix)]
    out: list[Rule] = []
    for k in range(cfg.mtp.depth):
        o, t = f"mtp_layers.{k}", f"model.layers.{cfg.n_layers + k}"
        out += [Rule((f"{o}.enorm.weight",), f"{t}.enorm.weight"), Rule((f"{o}.hnorm.weight",), f"{t}.hnorm.weight"),
                Rule((f"{o}.eh_proj.weight",), f"{t}.eh_proj.weight"),
                Rule((f"{o}.final_norm.weight",), f"{t}.shared_head.norm.weight"),
                Rule(("tok_embeddings.weight",), f"{t}.embed_tokens.weight", alias=True),
                Rule(("output.weight",), f"{t}.shared_head.head.weight", alias=True)]
        out += [replace(r, ours=tuple(f"{o}.block.{n.removeprefix(ours_prefix)}" for n in r.ours),
                        theirs=f"{t}.{r.theirs.removeprefix(theirs_prefix)}") for r in block]
    return out


ADAPTER = replace(llama_like.adapter(
    ARCH, "DeepseekV3ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "mla"),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "mla": True, "moe": True, "n_shared_experts": ANY,
                  "router_score": "sigmoid", "router_renormalize": {True, False}, "router_groups": ANY,
                  "router_scale": ANY, "moe_blocks": {"every block", "some"}, "grouped_query": False,
                  "head_dim": ANY},
    size_keys=(*llama_like.SIZE_KEYS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"),
    refused_names=(FP8,), ignored=r"^model\.layers\.61\.", holds_selection_bias=True,
), rules=rules)
