"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet blocks (layer_types "linear_attention": our
linear_attention blocks, whose token mixer `attn` holds what HF names `linear_attn`, [model.linear_attention] from
the linear_* keys) and gated attention blocks ("full_attention": Qwen3's attention with per-head QK-norm and a
sigmoid output gate read from the query projection = our attention.output_gate, rotating the first
partial_rotary_factor of each head = our rope.partial_factor). Every RMSNorm but the Gated DeltaNet's scales by
(1 + weight) = our norm.weight_offset = 1.

MoE blocks (decoder_sparse_step, mlp_only_layers as for Qwen3-MoE) route top-k of a softmax over all experts,
renormalised when norm_topk_prob, with per-expert mlp.experts.{j}.gate_proj / up_proj / down_proj (what
save_pretrained writes) and one shared expert of shared_expert_intermediate_size = our n_shared_experts x moe_d_ff,
gated by sigmoid(mlp.shared_expert_gate) = our moe.shared_expert_gate. router_aux_loss_coef <-> moe_aux_loss.
The multi-token-prediction weights of published checkpoints (mtp.*) are left unread.

Refused: attention_bias, a shared expert width that is not a multiple of moe_intermediate_size, another
hidden_act, mlp_only_layers other than the first blocks, rotary scaling other than ours.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY, PLAIN_KINDS, HFAdapter, refuse
from meshformer.checkpointing.megatron_config import moe_every_pattern
from meshformer.config import ModelConfig, MoeConfig
from meshformer.model.config import LinearAttentionConfig, moe_pattern
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like

ARCH = "qwen3_next"
EXPERTS: llama_like.Experts = ("mlp.gate", "mlp.experts.{j}.", ("gate_proj", "up_proj", "down_proj"))
# the Gated DeltaNet's tensors, the same names on both sides below the token mixer
LINEAR_PARAMS = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias", "A_log", "norm.weight",
                 "out_proj.weight")


def is_linear(cfg: ModelConfig, block: int) -> bool:
    """Whether block `block` is a Gated DeltaNet (linear_attention) block."""
    return cfg.layer_type(block) == "linear_attention"


def shortest_pattern(kinds: list[str]) -> list[str]:
    """The shortest list whose repetition gives `kinds` (our layer_types may be a repeated pattern)."""
    for size in range(1, len(kinds) + 1):
        if len(kinds) % size == 0 and kinds[:size] * (len(kinds) // size) == kinds:
            return kinds[:size]
    return kinds


class _RopeWithoutPartial:
    """A config whose rope_parameters lack partial_rotary_factor (read here, not by llama_like)."""

    def __init__(self, config: Any, rope: dict[str, Any]) -> None:
        self._config, self.rope_parameters = config, rope

    def __getattr__(self, key: str) -> Any:
        return getattr(self._config, key)


def hybrid_from_hf(c: Any, arch: str, drop_rope_keys: tuple[str, ...] = (), moe: MoeConfig | None = None,
                   mlp_types: list[str] | None = None) -> ModelConfig:
    """What Qwen3-Next and Qwen3.5 share: the Gated DeltaNet / gated attention blocks, partial RoPE, (1 + weight)
    norms; `drop_rope_keys` are rope_parameters the caller has already judged; `moe` and `mlp_types` its experts."""
    llama_like.refuse_attention_bias(c, arch)
    rope = {k: v for k, v in (c.rope_parameters or {}).items() if k not in drop_rope_keys}
    partial = float(rope.pop("partial_rotary_factor", None) or getattr(c, "partial_rotary_factor", None) or 1.0)
    cfg = llama_like.config_from_hf(_RopeWithoutPartial(c, rope), arch, window=False)
    kinds = list(c.layer_types)
    if set(kinds) - {"linear_attention", "full_attention"}:
        raise refuse(arch, f"layer_types={kinds}", "holds kinds other than linear_attention and full_attention")
    linear = LinearAttentionConfig(
        n_heads=c.linear_num_value_heads, n_key_heads=c.linear_num_key_heads, key_head_dim=c.linear_key_head_dim,
        value_head_dim=c.linear_value_head_dim, conv_width=c.linear_conv_kernel_dim)
    return replace(
        cfg, layer_types=shortest_pattern(kinds) if "linear_attention" in kinds else [], mlp_types=mlp_types or [],
        attention=replace(cfg.attention, qk_norm=True, output_gate=True),
        norm=replace(cfg.norm, weight_offset=1.0), rope=replace(cfg.rope, partial_factor=partial),
        linear_attention=linear, moe=moe or MoeConfig())


def hybrid_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The transformers config fields Qwen3-Next and Qwen3.5 share."""
    fields = llama_like.fields_to_hf(cfg)
    fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": cfg.rope.partial_factor}
    la = cfg.linear_attention
    return dict(
        **fields, intermediate_size=cfg.ffn.d_ff, attention_bias=False,
        layer_types=["linear_attention" if is_linear(cfg, i) else "full_attention" for i in range(cfg.n_layers)],
        linear_num_value_heads=la.n_heads, linear_num_key_heads=la.key_heads, linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim, linear_conv_kernel_dim=la.conv_width)


def hybrid_rules(cfg: ModelConfig, experts: llama_like.Experts | None, linear_params: tuple[str, ...]) -> list[Rule]:
    """Llama's names, with the Gated DeltaNet's `linear_params` under linear_attn in its blocks."""
    linear = {f"decoder_layers.{i}." for i in range(cfg.n_layers) if is_linear(cfg, i)}
    out = [r for r in llama_like.rules(cfg, experts)
           if not any(r.ours[0].startswith(f"{block}attn.") for block in linear)]
    for i in range(cfg.n_layers):
        if is_linear(cfg, i):
            out += [Rule((f"decoder_layers.{i}.attn.{p}",), f"model.layers.{i}.linear_attn.{p}")
                    for p in linear_params]
    return out


def moe_from_hf(c: Any, arch: str, router_renormalize: bool) -> MoeConfig:
    """Qwen3-Next's (and Qwen3.5-MoE's) experts beside one gated shared expert."""
    shared, width = c.shared_expert_intermediate_size, c.moe_intermediate_size
    if shared < width or shared % width:
        raise refuse(arch, f"shared_expert_intermediate_size={shared}", f"is not a multiple of "
                     f"moe_intermediate_size={width} (meshformer's shared experts are n_shared_experts x "
                     "moe_d_ff wide)")
    return MoeConfig(n_experts=c.num_experts, experts_per_token=c.num_experts_per_tok, d_ff=width,
                     n_shared_experts=shared // width, shared_expert_gate=True, router_renormalize=router_renormalize,
                     aux_loss=c.router_aux_loss_coef)


def shared_expert_rules(cfg: ModelConfig) -> list[Rule]:
    """The shared expert and its gate of every MoE block."""
    out: list[Rule] = []
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"model.layers.{i}"
        if cfg.is_moe(i):
            out += [Rule((f"{o}.ffn.shared_experts.{p}_proj.weight",), f"{t}.mlp.shared_expert.{p}_proj.weight")
                    for p in ("gate", "up", "down")]
            out.append(Rule((f"{o}.ffn.shared_expert_gate.weight",), f"{t}.mlp.shared_expert_gate.weight"))
    return out


def config_from_hf(c: Any) -> ModelConfig:
    if c.num_experts == 0:
        return hybrid_from_hf(c, ARCH)
    return hybrid_from_hf(c, ARCH, moe=moe_from_hf(c, ARCH, bool(c.norm_topk_prob)),
                          mlp_types=moe_pattern(c.decoder_sparse_step, len(c.mlp_only_layers or []),
                                                c.num_hidden_layers))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    first_dense, every = moe_every_pattern([cfg.is_moe(i) for i in range(cfg.n_layers)])
    moe = cfg.moe.n_experts > 0
    return transformers.Qwen3NextConfig(
        **hybrid_to_hf(cfg), num_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        moe_intermediate_size=cfg.expert_d_ff,
        shared_expert_intermediate_size=cfg.moe.n_shared_experts * cfg.expert_d_ff if moe else 0,
        norm_topk_prob=cfg.moe.router_renormalize, decoder_sparse_step=every if moe else 1,
        mlp_only_layers=list(range(first_dense)) if moe else [], router_aux_loss_coef=cfg.moe.aux_loss)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Llama's names with the Qwen3-MoE experts, Gated DeltaNet's in the linear_attention blocks, the shared
    expert and its gate in the MoE blocks."""
    return hybrid_rules(cfg, EXPERTS, LINEAR_PARAMS) + shared_expert_rules(cfg)


def extra_features(cfg: ModelConfig) -> dict[str, Any]:
    """MoE blocks have the one gated shared expert Qwen3-Next always builds; its Gated DeltaNet stores the grouped
    projections."""
    moe = cfg.moe.n_experts > 0
    linear = "linear_attention" in cfg.layer_types
    return {"gated_shared_expert": not moe or (cfg.moe.n_shared_experts > 0 and cfg.moe.shared_expert_gate),
            "grouped_linear_projections": not linear or cfg.linear_attention.projections == "grouped"}


ADAPTER = HFAdapter(
    model_type=ARCH, model_class="Qwen3NextForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    kinds=(*PLAIN_KINDS, "linear_attention"),
    rules=rules, base_prefix="model.", layer_keys=("num_hidden_layers",),
    hf_layer_types=("linear_attention", "full_attention"),
    requirements={**llama_like.REQUIREMENTS, "bias": False, "qk_norm": True, "norm_weight_offset": 1.0,
                  "attention_output_gate": True, "rope_partial_factor": ANY, "linear_attention": {True, False},
                  "moe": {True, False}, "n_shared_experts": ANY, "shared_expert_gate": {True, False},
                  "gated_shared_expert": True, "router_renormalize": {True, False},
                  "moe_blocks": {"every block", "some"}, "grouped_linear_projections": True},
    extra_features=extra_features,
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "linear_num_value_heads", "linear_num_key_heads",
               "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"),
    ignored=r"^mtp\.",
)
