"""Nemotron-H (NemotronHForCausalLM): pre-norm layers that each hold ONE mixer behind one RMSNorm and a residual, by
`layers_block_type` (the older hybrid_override_pattern's letters): Mamba-2 ("linear_attention", "M"), attention
without positions ("full_attention", "*"), a squared-ReLU MLP ("mlp", "-") or a mixture of experts ("moe", "E"). HF
layer i is our block i with the other sub-layer `none`: an M block is (mamba2, none), a * block (full_attention, none),
a - block (none, dense), an E block (none, moe).

Experts (E layers, our [model.moe]): the router mixer.gate (sigmoid scores, fp32; its e_score_correction_bias = our
router.expert_bias, the selection bias), n_group / topk_group = our router_groups / router_groups_per_token,
norm_topk_prob = router_renormalize, routed_scaling_factor = router_scale; n_routed_experts squared-ReLU experts
without a gate (up_proj / down_proj, moe_intermediate_size wide) and one always-on squared-ReLU MLP
moe_shared_expert_intermediate_size wide = our n_shared_experts shared experts of the experts' width, as one FFN.

Tensor names as the checkpoints store them (transformers renames backbone.* to model.* in memory):
backbone.embeddings, backbone.norm_f, lm_head; per layer backbone.layers.{i}.norm (our attn_norm or ffn_norm,
whichever the block holds) and backbone.layers.{i}.mixer.* (a Mamba-2 mixer's names are ours; attention's
q/k/v/o_proj; the MLP's up_proj / down_proj; the experts' gate, experts.{j}.up_proj / down_proj, shared_experts).

Refused: a latent projection around the experts (moe_latent_size), a shared MLP whose width is no multiple of the
experts', multi-token prediction, biases (use_bias, mlp_bias, attention_bias, mamba_proj_bias), another
mlp_hidden_act or mamba_hidden_act, a time_step_limit with an upper bound, sliding windows.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, COMMON, PLAIN_KINDS, HFAdapter, refuse
from meshformer.config import ModelConfig
from meshformer.model.config import AttentionConfig, FfnConfig, InitConfig, MambaConfig, MoeConfig, NormConfig
from meshformer.model.families.naming import Rule, expert_params, params

ARCH = "nemotron_h"
# their layers_block_type -> our (token mixer, channel mixer)
KINDS = {"linear_attention": ("mamba2", "none"), "full_attention": ("full_attention", "none"),
         "mlp": ("none", "dense"), "moe": ("none", "moe")}
_MAMBA = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def _refuse_unsupported(c: Any) -> None:
    for kind in c.layers_block_type:
        if kind not in KINDS:
            raise refuse(ARCH, f"layers_block_type {kind!r}", "is a kind of layer this import lacks")
    if "moe" in c.layers_block_type:
        if getattr(c, "moe_latent_size", None) is not None:
            raise refuse(ARCH, f"moe_latent_size={c.moe_latent_size}", "projects the experts' input to a latent width")
        if c.moe_shared_expert_intermediate_size % c.moe_intermediate_size:
            raise refuse(ARCH, f"moe_shared_expert_intermediate_size={c.moe_shared_expert_intermediate_size}",
                         f"is no multiple of moe_intermediate_size={c.moe_intermediate_size}")
    for key in ("use_bias", "mlp_bias", "attention_bias", "mamba_proj_bias"):
        if getattr(c, key, False):
            raise refuse(ARCH, f"{key}=True", "adds biases")
    if c.mlp_hidden_act != "relu2":
        raise refuse(ARCH, f"mlp_hidden_act={c.mlp_hidden_act!r}", "is another MLP activation")
    if c.mamba_hidden_act != "silu":
        raise refuse(ARCH, f"mamba_hidden_act={c.mamba_hidden_act!r}", "is another Mamba-2 activation")
    if getattr(c, "num_nextn_predict_layers", 0):
        raise refuse(ARCH, f"num_nextn_predict_layers={c.num_nextn_predict_layers}", "adds multi-token prediction")
    if getattr(c, "sliding_window", None) is not None:
        raise refuse(ARCH, f"sliding_window={c.sliding_window}", "limits attention to a window")


def _moe_from_hf(c: Any) -> MoeConfig:
    """The experts of the E layers (none: the default, no experts)."""
    if "moe" not in c.layers_block_type:
        return MoeConfig()
    return MoeConfig(
        n_experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok, d_ff=c.moe_intermediate_size,
        n_shared_experts=c.moe_shared_expert_intermediate_size // c.moe_intermediate_size, router_score="sigmoid",
        router_renormalize=bool(c.norm_topk_prob), router_groups=c.n_group or 1,
        router_groups_per_token=c.topk_group or 1, router_scale=float(c.routed_scaling_factor))


def config_from_hf(c: Any) -> ModelConfig:
    _refuse_unsupported(c)
    kinds = [KINDS[kind] for kind in c.layers_block_type]
    return ModelConfig(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=len(kinds), position="none",
        bias=False, max_seq_len=c.max_position_embeddings, tie_embeddings=bool(c.tie_word_embeddings),
        layer_types=[token for token, _ in kinds], mlp_types=[channel for _, channel in kinds],
        attention=AttentionConfig(n_heads=c.num_attention_heads, n_kv_heads=(
            None if c.num_key_value_heads == c.num_attention_heads else c.num_key_value_heads), head_dim=c.head_dim,
            dropout=float(c.attention_dropout)),
        ffn=FfnConfig(d_ff=c.intermediate_size, activation="relu2"), moe=_moe_from_hf(c),
        norm=NormConfig(kind="rmsnorm", eps=c.layer_norm_epsilon, position="pre"),
        mamba=MambaConfig(n_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim, state_size=c.ssm_state_size,
                          n_groups=c.n_groups, conv_width=c.conv_kernel, conv_bias=bool(c.use_conv_bias),
                          chunk_size=c.chunk_size, dt_floor=float(c.time_step_min)),
        init=InitConfig(std=c.initializer_range))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    theirs = {ours: kind for kind, ours in KINDS.items()}
    m, e = cfg.mamba, cfg.moe
    experts: dict[str, Any] = dict(
        n_routed_experts=e.n_experts, num_experts_per_tok=e.experts_per_token, moe_intermediate_size=cfg.expert_d_ff,
        moe_shared_expert_intermediate_size=e.n_shared_experts * cfg.expert_d_ff, n_shared_experts=e.n_shared_experts,
        n_group=e.router_groups, topk_group=e.router_groups_per_token, norm_topk_prob=e.router_renormalize,
        routed_scaling_factor=e.router_scale, moe_latent_size=None) if e.n_experts else {}
    return transformers.NemotronHConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, tie_word_embeddings=cfg.tie_embeddings,
        layers_block_type=[theirs[(cfg.layer_type(i), cfg.mlp_type(i))] for i in range(cfg.n_layers)],
        num_attention_heads=cfg.attention.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.attention_head_dim, max_position_embeddings=cfg.max_seq_len,
        attention_dropout=cfg.attention.dropout, intermediate_size=cfg.ffn.d_ff, mlp_hidden_act="relu2",
        ssm_state_size=m.state_size, mamba_num_heads=m.n_heads, mamba_head_dim=m.head_dim, n_groups=m.n_groups,
        conv_kernel=m.conv_width, use_conv_bias=m.conv_bias, chunk_size=m.chunk_size, time_step_min=m.dt_floor,
        initializer_range=cfg.init.std, layer_norm_epsilon=cfg.norm.eps, num_nextn_predict_layers=0,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **experts)


def rules(cfg: ModelConfig) -> list[Rule]:
    out = [Rule(("tok_embeddings.weight",), "backbone.embeddings.weight"),
           Rule(("decoder_norm.weight",), "backbone.norm_f.weight"),
           Rule(("output.weight",), "lm_head.weight", alias=cfg.tie_embeddings)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"backbone.layers.{i}.mixer"
        token = cfg.layer_type(i)
        norm = "ffn_norm" if token == "none" else "attn_norm"  # the one sub-layer's norm
        out.append(Rule((f"{o}.{norm}.weight",), f"backbone.layers.{i}.norm.weight"))
        if token == "mamba2":
            names = (*_MAMBA, "conv1d.bias") if cfg.mamba.conv_bias else _MAMBA
            out += [Rule((f"{o}.attn.{p}",), f"{t}.{p}") for p in names]
        elif token == "full_attention":
            out += [Rule((f"{o}.attn.{p}_proj.weight",), f"{t}.{p}_proj.weight") for p in "qkvo"]
        elif cfg.is_moe(i):
            out += [Rule((f"{o}.ffn.router.weight",), f"{t}.gate.weight"),
                    Rule((f"{o}.ffn.router.expert_bias",), f"{t}.gate.e_score_correction_bias")]
            for p in ("up_proj", "down_proj"):
                out += expert_params(f"{o}.ffn.experts.{p}", f"{t}.experts.{{j}}.{p}.weight", cfg.moe.n_experts)
                out += params(f"{o}.ffn.shared_experts.{p}", f"{t}.shared_experts.{p}", ("weight",))
        else:
            out += [Rule((f"{o}.ffn.{p}_proj.weight",), f"{t}.{p}_proj.weight") for p in ("up", "down")]
    return out


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """Each block holds exactly one of Nemotron-H's mixers; experts route by sigmoid scores beside an always-on MLP."""
    pairs = {(cfg.layer_type(i), cfg.mlp_type(i)) for i in range(cfg.n_layers)}
    moe = cfg.moe.n_experts > 0
    return {"nemotron_blocks": bool(cfg.layer_types) and pairs <= set(KINDS.values()),
            "mamba2": "mamba2" in cfg.layer_types,
            "nemotron_router": cfg.moe.router_score if moe else "sigmoid",
            "nemotron_shared_mlp": cfg.moe.n_shared_experts > 0 or not moe}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="NemotronHForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "mamba2", "none"),
    rules=rules, base_prefix="backbone.",
    requirements={**COMMON, "family": "decoder", "position": "none", "norm": "rmsnorm", "bias": False,
                  "activation": "relu2", "grouped_query": {False, True}, "head_dim": ANY,
                  "tie_embeddings": {False, True}, "nemotron_blocks": True, "mamba2": {False, True},
                  "moe": {False, True}, "moe_blocks": {"every block", "some"}, "n_shared_experts": ANY,
                  "router_score": ANY, "nemotron_router": "sigmoid", "nemotron_shared_mlp": True,
                  "router_renormalize": {True, False}, "router_groups": ANY, "router_scale": ANY},
    extra_features=extra_features,
    size_keys=("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "n_routed_experts",
               "num_experts_per_tok", "moe_intermediate_size"),
    hf_layer_types=("linear_attention", "full_attention", "mlp", "moe"), holds_selection_bias=True,
)
