"""DeepSeek-V4 (DeepseekV4ForCausalLM): every block a V4 attention kind and an MoE, joined by mHC.

Blocks: layer_types sliding_attention / compressed_sparse_attention / heavily_compressed_attention = our token-mixer
kinds "sliding_mqa" / "csa" / "hca" ([model.compressed_attention]: q_lora_rank, qk_rope_head_dim (head_dim x
partial_rotary_factor), sliding_window, o_groups, o_lora_rank, rope_theta, compress_rope_theta, compress_rates,
index_n_heads, index_head_dim, index_topk); mlp_layer_types hash_moe / moe = our channel mixers "hash_moe" (tid2eid =
our experts_of_token) / "moe" (sqrt-softplus scores, gate.bias = our router.expert_bias). Each block's MoE has one
shared expert moe_intermediate_size wide. The residual is mHC ([model.residual] kind "mhc": hc_mult streams,
hc_sinkhorn_iters, hc_eps; hc_attn_* / hc_ffn_* = our attn_residual / ffn_residual, hc_head_* = our decoder_merge).

Names are the published checkpoint's (layers.{i}.attn.wq_a, .ffn.experts.{j}.w1, ...), which transformers renames on
load. Refused: a key/value head count other than 1, attention or MLP biases, another router score or unnormalised
top-k weights, rope scaling of the sliding-only blocks, and of the compressed blocks any but YaRN with cos/sin unscaled.
The compressed blocks' YaRN (rope_parameters["compress"], as transformers nests a flat yarn rope_parameters) = our
compressed_attention.yarn_*. The feed-forwards' swiglu_limit (the clamp of gate and up pre-activations, 10 as
published) is our activation "swiglu_limited" with model.ffn.swiglu_limit.

Multi-token prediction: with model.mtp.depth > 0 our module k (model/mtp.py HyperMtpModule) is the published
mtp.{k}.* (e_proj, h_proj, enorm, hnorm, norm, hc_head_* = our merge, and a sliding_mqa / moe block named as the
main blocks but for attn.kv_norm), read on import and written on export (num_nextn_predict_layers = depth). An
import builds depth 0 unless model.mtp.depth is set (transformers' configs name num_nextn_predict_layers = 1 by
default); at depth 0 the mtp.* tensors are left unread, as transformers leaves them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, COMMON, PLAIN_KINDS, HFAdapter, refuse
from meshformer.config import ModelConfig
from meshformer.config.migrate import model_from_flat
from meshformer.model.config import CompressedAttentionConfig, MtpConfig, ResidualConfig
from meshformer.model.families.naming import Rule, expert_params
from meshformer.model.mtp import block_kinds

ARCH = "deepseek_v4"
HF_TYPES = {"sliding_attention": "sliding_mqa", "compressed_sparse_attention": "csa",
            "heavily_compressed_attention": "hca"}
OURS_TYPES = {v: k for k, v in HF_TYPES.items()}
_ATTENTION = {"q_a_proj.weight": "wq_a.weight", "q_a_norm.weight": "q_norm.weight", "q_b_proj.weight": "wq_b.weight",
              "kv_proj.weight": "wkv.weight", "kv_norm.weight": "norm.weight", "sinks": "attn_sink",
              "output.o_a_proj": "wo_a.weight", "output.o_b_proj.weight": "wo_b.weight"}
_COMPRESSOR = {"kv_proj.weight": "wkv.weight", "gate_proj.weight": "wgate.weight", "kv_norm.weight": "norm.weight",
               "position_bias": "ape"}
_INDEXER = {"q_b_proj.weight": "wq_b.weight", "weights_proj.weight": "weights_proj.weight"}
_HYPER = {"weight": "fn", "bias": "base", "gain": "scale"}
# the MTP block's attention as the published checkpoint names it (mtp.0.attn.kv_norm; the main blocks' kv norm takes
# the name transformers' save writes, attn.norm, which transformers reads back as either)
_MTP_ATTENTION = {**_ATTENTION, "kv_norm.weight": "kv_norm.weight"}
# the published MTP block: a sliding-window block (no compressor) with a learned router
MTP_KINDS = ("sliding_mqa", "moe")


def config_from_hf(c: Any) -> ModelConfig:
    if c.num_key_value_heads not in (None, 1):
        raise refuse(ARCH, f"num_key_value_heads={c.num_key_value_heads}", "is not the one shared key/value head")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(c, flag):
            raise refuse(ARCH, f"{flag}=True", "puts biases on linears meshformer's V4 blocks have without")
    if c.hidden_act != "silu":
        raise refuse(ARCH, f"hidden_act={c.hidden_act!r}", "changes the gated MLP (meshformer gates with silu)")
    if c.scoring_func != "sqrtsoftplus" or not c.norm_topk_prob:
        raise refuse(ARCH, f"scoring_func={c.scoring_func!r}, norm_topk_prob={c.norm_topk_prob}",
                     "is not V4's routing (sqrt-softplus scores, top-k weights normalised)")
    ropes = c.rope_parameters or {}
    main, compress = ropes.get("main", {}), ropes.get("compress", {})
    if main.get("rope_type", "default") != "default":
        raise refuse(ARCH, f"rope_parameters['main'].rope_type={main['rope_type']!r}",
                     "scales the sliding-only blocks' rotary (V4 scales only the compressed blocks')")
    yarn = _compress_yarn(c, compress)
    rates = c.compress_rates
    cfg = model_from_flat(
        family="decoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=c.num_attention_heads, head_dim=c.head_dim, d_ff=c.moe_intermediate_size, activation="swiglu_limited",
        norm="rmsnorm", norm_eps=c.rms_norm_eps, norm_position="pre", position="none", bias=False,
        max_seq_len=c.max_position_embeddings, tie_embeddings=c.tie_word_embeddings,
        attention_dropout=c.attention_dropout, init_std=c.initializer_range,
        layer_types=[HF_TYPES[t] for t in c.layer_types], mlp_types=list(c.mlp_layer_types),
        n_experts=c.n_routed_experts, experts_per_token=c.num_experts_per_tok, moe_d_ff=c.moe_intermediate_size,
        n_shared_experts=1, router_score="sqrt_softplus", router_renormalize=True,
        router_scale=float(c.routed_scaling_factor), moe_aux_loss=c.router_aux_loss_coef)
    attention = CompressedAttentionConfig(
        q_rank=c.q_lora_rank, rope_dim=c.qk_rope_head_dim, window=c.sliding_window, o_groups=c.o_groups,
        o_rank=c.o_lora_rank, rope_theta=float(main.get("rope_theta", c.rope_theta)),
        compress_theta=float(compress.get("rope_theta", c.compress_rope_theta)),
        hca_rate=rates["heavily_compressed_attention"], csa_rate=rates["compressed_sparse_attention"],
        index_heads=c.index_n_heads, index_dim=c.index_head_dim, index_topk=c.index_topk, **yarn)
    return replace(cfg, ffn=replace(cfg.ffn, swiglu_limit=float(c.swiglu_limit)), compressed_attention=attention,
                   mtp=MtpConfig(layer_type=MTP_KINDS[0], mlp_type=MTP_KINDS[1]),
                   residual=ResidualConfig(kind="mhc", streams=c.hc_mult, sinkhorn_iters=c.hc_sinkhorn_iters,
                                           eps=c.hc_eps))


def _compress_yarn(c: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Our yarn_* keys of the compressed blocks' rope parameters (none where they rotate unscaled); transformers'
    V4 sets their attention factor to 1 (cos/sin unmultiplied) unless the config names another."""
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return {}
    if kind != "yarn":
        raise refuse(ARCH, f"rope_parameters['compress'].rope_type={kind!r}",
                     "scales the compressed blocks' rotary other than by YaRN")
    if rope.get("attention_factor", 1.0) != 1.0:
        raise refuse(ARCH, f"rope_parameters['compress'].attention_factor={rope['attention_factor']}",
                     "multiplies the compressed blocks' cos/sin (V4 leaves them at 1)")
    if rope.get("truncate", True) is not True:
        raise refuse(ARCH, "rope_parameters['compress'].truncate=False", "leaves YaRN's ramp ends unrounded")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or c.max_position_embeddings / original
    return {"yarn_factor": float(factor), "yarn_original_max_seq_len": original,
            "yarn_beta_fast": float(rope.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(rope.get("beta_slow") or 1.0)}


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    a, m, r = cfg.compressed_attention, cfg.moe, cfg.residual
    # a flat yarn rope_parameters: transformers nests it as the compressed blocks' ("compress")
    yarn: dict[str, Any] | None = None if a.yarn_factor == 1 else {
        "rope_type": "yarn", "factor": a.yarn_factor, "original_max_position_embeddings": a.yarn_original_max_seq_len,
        "beta_fast": a.yarn_beta_fast, "beta_slow": a.yarn_beta_slow}
    return transformers.DeepseekV4Config(
        rope_parameters=yarn,
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads, num_key_value_heads=1, head_dim=cfg.attention_head_dim,
        partial_rotary_factor=a.rope_dim / cfg.attention_head_dim, q_lora_rank=a.q_rank, o_groups=a.o_groups,
        o_lora_rank=a.o_rank, sliding_window=a.window, rope_theta=a.rope_theta, compress_rope_theta=a.compress_theta,
        compress_rates={"compressed_sparse_attention": a.csa_rate, "heavily_compressed_attention": a.hca_rate},
        index_n_heads=a.index_heads, index_head_dim=a.index_dim, index_topk=a.index_topk,
        layer_types=[OURS_TYPES[cfg.layer_type(i)] for i in range(cfg.n_layers)],
        mlp_layer_types=[cfg.mlp_type(i) for i in range(cfg.n_layers)],
        n_routed_experts=m.n_experts, num_experts_per_tok=m.experts_per_token, moe_intermediate_size=cfg.expert_d_ff,
        n_shared_experts=1, swiglu_limit=cfg.ffn.swiglu_limit, routed_scaling_factor=m.router_scale,
        router_aux_loss_coef=m.aux_loss,
        hc_mult=r.streams, hc_sinkhorn_iters=r.sinkhorn_iters, hc_eps=r.eps, rms_norm_eps=cfg.norm.eps,
        max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=cfg.attention.dropout, initializer_range=cfg.init.std,
        num_nextn_predict_layers=cfg.mtp.depth,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def rules(cfg: ModelConfig) -> list[Rule]:
    """The published checkpoint's names, as transformers' revert of its renames gives them."""
    out = [Rule(("tok_embeddings.weight",), "model.embed_tokens.weight"),
           Rule(("decoder_norm.weight",), "model.norm.weight"),
           Rule(("output.weight",), "head.weight", alias=cfg.tie_embeddings)]
    out += [Rule((f"decoder_merge.{ours}",), f"model.hc_head.hc_{theirs}") for ours, theirs in _HYPER.items()]
    for i in range(cfg.n_layers):
        out += _block(cfg, i, f"decoder_layers.{i}", f"model.layers.{i}", _ATTENTION)
    kinds, index = block_kinds(cfg)
    for k in range(cfg.mtp.depth):
        o, t = f"mtp_layers.{k}", f"mtp.{k}"
        out += [Rule((f"{o}.{ours}.weight",), f"{t}.{theirs}.weight")
                for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("e_proj", "e_proj"),
                                     ("h_proj", "h_proj"), ("final_norm", "norm"))]
        out += [Rule((f"{o}.merge.{ours}",), f"{t}.hc_head_{theirs}") for ours, theirs in _HYPER.items()]
        out += _block(kinds, index, f"{o}.block", t, _MTP_ATTENTION)
    return out


def _block(cfg: ModelConfig, i: int, o: str, t: str, attention: dict[str, str]) -> list[Rule]:
    """Block `i`'s tensors (its kinds), ours under `o`, theirs under `t`."""
    out = [Rule((f"{o}.attn_norm.weight",), f"{t}.attn_norm.weight"),
           Rule((f"{o}.ffn_norm.weight",), f"{t}.ffn_norm.weight")]
    for branch in ("attn", "ffn"):
        out += [Rule((f"{o}.{branch}_residual.{ours}",), f"{t}.hc_{branch}_{theirs}")
                for ours, theirs in _HYPER.items()]
    out += [Rule((f"{o}.attn.{ours}",), f"{t}.attn.{theirs}") for ours, theirs in attention.items()]
    kind = cfg.layer_type(i)
    if kind in ("hca", "csa"):
        out += [Rule((f"{o}.attn.compressor.{ours}",), f"{t}.attn.compressor.{theirs}")
                for ours, theirs in _COMPRESSOR.items()]
    if kind == "csa":
        out += [Rule((f"{o}.attn.indexer.{ours}",), f"{t}.attn.indexer.compressor.{theirs}")
                for ours, theirs in _COMPRESSOR.items()]
        out += [Rule((f"{o}.attn.indexer.{ours}",), f"{t}.attn.indexer.{theirs}")
                for ours, theirs in _INDEXER.items()]
    f, g = f"{o}.ffn", f"{t}.ffn"
    out += [Rule((f"{f}.router.weight",), f"{g}.gate.weight")]
    if cfg.mlp_type(i) == "hash_moe":
        out += [Rule((f"{f}.experts_of_token",), f"{g}.gate.tid2eid")]
    else:
        out += [Rule((f"{f}.router.expert_bias",), f"{g}.gate.bias")]
    for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        out += expert_params(f"{f}.experts.{ours}", f"{g}.experts.{{j}}.{theirs}.weight", cfg.moe.n_experts)
        out += [Rule((f"{f}.shared_experts.{ours}.weight",), f"{g}.shared_experts.{theirs}.weight")]
    return out


def _features(cfg: ModelConfig) -> dict[str, Any]:
    kinds, index = block_kinds(cfg)
    return {"residual": cfg.residual.kind, "mtp_depth": cfg.mtp.depth,
            "mtp_block": (kinds.layer_type(index), kinds.mlp_type(index)) if cfg.mtp.depth else MTP_KINDS,
            "every_block_v4": all(cfg.layer_type(i) in OURS_TYPES for i in range(cfg.n_layers)),
            "every_block_moe": all(cfg.mlp_type(i) in ("hash_moe", "moe") for i in range(cfg.n_layers))}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="DeepseekV4ForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "sliding_mqa", "hca", "csa", "hash_moe"),
    expresses=("residual.kind", "residual.streams", "residual.sinkhorn_iters", "residual.eps", "ffn.swiglu_limit",
               "mtp.layer_type", "mtp.mlp_type"),
    requirements={**COMMON, "family": "decoder", "position": "none", "norm": "rmsnorm",
                  "activation": "swiglu_limited",
                  "bias": False, "moe": True, "n_shared_experts": 1, "router_score": "sqrt_softplus",
                  "router_scale": ANY, "hash_routing": {True, False}, "compressed_attention": True, "head_dim": ANY,
                  "tie_embeddings": {True, False}, "residual": "mhc", "mtp_depth": ANY,
                  "mtp_block": MTP_KINDS,
                  "every_block_v4": True, "every_block_moe": True},
    rules=rules, base_prefix="model.", keep_prefix=("head.", "mtp."),
    size_keys=("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
               "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
               "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "hc_mult",
               "max_position_embeddings"),
    layer_keys=("num_hidden_layers",), hf_layer_types=tuple(HF_TYPES), extra_features=_features,
    ignored=r"^(model\.)?mtp\.", holds_selection_bias=True,
)
