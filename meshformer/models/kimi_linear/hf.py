"""Kimi Linear (KimiLinearForCausalLM): Llama's pre-norm blocks and names, each block's token mixer either Kimi Delta
Attention (HF layer_types "linear_attention" = our "kda", [model.linear_attention] from linear_num_heads,
linear_head_dim and linear_conv_kernel_dim) or multi-head latent attention without RoPE ("full_attention" = our
"mla" with model.position "none": the qk_rope_head_dim part of the queries and the shared key enters unrotated), and
DeepSeek-V3's experts (sigmoid router with a selection bias, groups, routed_scaling_factor, shared experts) in the
blocks mlp_layer_types names "sparse" (our mlp_types "moe"), the others a dense MLP of intermediate_size.

Tensor names as the checkpoints store them (what save_pretrained writes): a KDA block's self_attn.q_proj / k_proj /
v_proj, q_conv1d / k_conv1d / v_conv1d, f_a_proj / f_b_proj / dt_bias / A_log (stored (1, 1, H, 1), ours (H,)),
b_proj, g_a_proj / g_b_proj, o_norm (our norm) and o_proj (our out_proj); an MLA block's as DeepSeek-V3's. Every
block's feed-forward is block_sparse_moe: a MoE block's gate (+ e_score_correction_bias), experts.{j}.w1 / w3 / w2
(gate / up / down) and shared_experts, a dense block's gate_proj / up_proj / down_proj (as save_pretrained writes them;
the published checkpoints' mlp.*_proj spelling of the dense ones is read too).

Refused: attention_bias, num_key_value_heads other than num_attention_heads, another hidden_act (DeepSeek-V3's rules).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, HFAdapter
from meshformer.config import ModelConfig
from meshformer.model.config import LinearAttentionConfig
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like
from meshformer.models.deepseek_v3.hf import mla_config_from_hf, mla_rules, shared_expert_rules
from meshformer.models.qwen3_next.hf import shortest_pattern

ARCH = "kimi_linear"
MOE = "block_sparse_moe"  # a MoE block's feed-forward module
EXPERTS: llama_like.Experts = (f"{MOE}.gate", f"{MOE}.experts.{{j}}.", ("w1", "w3", "w2"))
KINDS = {"linear_attention": "kda", "full_attention": "mla"}  # their layer_types -> ours
# a KDA block's tensors: ours -> theirs under the token mixer (the rest are named alike)
_KDA = {"norm.weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
_KDA_SAME = (*(f"{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "b_proj",
                                        "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj")), "dt_bias")
_DENSE_PUBLISHED = re.compile(r"^(model\.layers\.\d+\.)mlp\.((?:gate|up|down)_proj\.weight)$")


class _DeepseekView:
    """The config as DeepSeek-V3's field reader takes it: no rotary parameters, its own expert-count name, and no
    dense-first count (mlp_layer_types is read here)."""

    def __init__(self, c: Any) -> None:
        self._c = c
        self.rope_parameters: dict[str, Any] = {}
        self.n_routed_experts = c.num_local_experts
        self.first_k_dense_replace = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)


def config_from_hf(c: Any) -> ModelConfig:
    cfg = mla_config_from_hf(_DeepseekView(c), ARCH, router_score="sigmoid",
                             router_renormalize=bool(c.norm_topk_prob), router_groups=c.n_group or 1,
                             router_groups_per_token=c.topk_group or 1)
    cfg.position = "none"
    cfg.layer_types = shortest_pattern([KINDS[kind] for kind in c.layer_types])
    moe = ["moe" if kind == "sparse" else "dense" for kind in c.mlp_layer_types]
    cfg.mlp_types = shortest_pattern(moe) if "moe" in moe else ["dense"]
    cfg.linear_attention = LinearAttentionConfig(n_heads=c.linear_num_heads, key_head_dim=c.linear_head_dim,
                                                 value_head_dim=c.linear_head_dim,
                                                 conv_width=c.linear_conv_kernel_dim)
    return cfg


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    m, la = cfg.mla, cfg.linear_attention
    theirs = {ours: kind for kind, ours in KINDS.items()}
    return transformers.KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn.d_ff,
        moe_intermediate_size=cfg.expert_d_ff, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.attention.n_heads,
        n_shared_experts=cfg.moe.n_shared_experts, routed_scaling_factor=cfg.moe.router_scale,
        kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, n_group=cfg.moe.router_groups,
        topk_group=cfg.moe.router_groups_per_token, num_experts_per_tok=cfg.moe.experts_per_token,
        norm_topk_prob=cfg.moe.router_renormalize, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init.std, rms_norm_eps=cfg.norm.eps, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, attention_dropout=cfg.attention.dropout, num_local_experts=cfg.moe.n_experts,
        mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.n_layers)],
        layer_types=[theirs[cfg.layer_type(i)] for i in range(cfg.n_layers)], linear_head_dim=la.key_head_dim,
        linear_num_heads=la.n_heads, linear_conv_kernel_dim=la.conv_width, pad_token_id=None, bos_token_id=None,
        eos_token_id=None)


def kda_rules(cfg: ModelConfig, block: int) -> list[Rule]:
    """One KDA block's token mixer."""
    o, t = f"decoder_layers.{block}.attn", f"model.layers.{block}.self_attn"
    out = [Rule((f"{o}.{p}",), f"{t}.{p}") for p in _KDA_SAME]
    out += [Rule((f"{o}.{ours}",), f"{t}.{theirs}") for ours, theirs in _KDA.items()]
    return [*out, Rule((f"{o}.A_log",), f"{t}.A_log", theirs_shape=(1, 1, cfg.linear_attention.n_heads, 1))]


def rules(cfg: ModelConfig) -> list[Rule]:
    """Llama's embeddings, norms and MLPs with the experts under block_sparse_moe; per block, KDA's or MLA's
    token mixer."""
    out = [replace(r, theirs=r.theirs.replace(".mlp.", f".{MOE}."))
           for r in [*llama_like.rules(cfg, EXPERTS), *shared_expert_rules(cfg, True)] if ".attn." not in r.ours[0]]
    mla = [r for r in mla_rules(cfg, selection_bias=False) if ".attn." in r.ours[0]]
    for i in range(cfg.n_layers):
        if cfg.layer_type(i) == "kda":
            out += kda_rules(cfg, i)
        else:
            out += [r for r in mla if r.ours[0].startswith(f"decoder_layers.{i}.attn.")]
    return out


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Its blocks are KDA or latent attention, and a KDA head's keys and values are equally wide (linear_head_dim)."""
    la = cfg.linear_attention
    return {"kimi_blocks": bool(cfg.layer_types) and set(cfg.layer_types) <= set(KINDS.values()),
            "kda_equal_head_widths": "kda" not in cfg.layer_types or la.key_head_dim == la.value_head_dim}


def old_names(name: str) -> str:
    """The published checkpoints' spelling of a dense block's MLP (mlp.gate_proj) -> save_pretrained's
    (block_sparse_moe.gate_proj)."""
    return _DENSE_PUBLISHED.sub(rf"\1{MOE}.\2", name)


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="KimiLinearForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "mla", "kda"),
    rules=rules, base_prefix="model.", layer_keys=("num_hidden_layers",),
    requirements={**llama_like.REQUIREMENTS, "position": "none", "bias": False, "mla": {True, False},
                  "kda": {True, False}, "moe": True, "n_shared_experts": ANY, "router_score": "sigmoid",
                  "router_renormalize": {True, False}, "router_groups": ANY, "router_scale": ANY,
                  "moe_blocks": {"every block", "some"}, "grouped_query": False, "head_dim": ANY,
                  "kimi_blocks": True, "kda_equal_head_widths": True},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "linear_num_heads",
               "linear_head_dim", "linear_conv_kernel_dim"),
    old_names=old_names, holds_selection_bias=True, hf_layer_types=("linear_attention", "full_attention"),
)
