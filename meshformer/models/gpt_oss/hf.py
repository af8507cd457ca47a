"""gpt-oss (GptOssForCausalLM): Llama's pre-norm blocks and names with a learned sink logit per head
(self_attn.sinks = our attn.sinks.weight), biases on q / k / v / o (attention_bias = our model.bias), every block
MoE. Its layer_types alternate sliding and full attention: sliding_window on the blocks marked "sliding_attention"
= our attention_window with full_attention_every (transformers' default: block 0 windowed, every 2nd global); every
block rotates with the same YaRN (truncate false = our rope_truncate false), windowed ones included.

The router (mlp.router: weight and bias = our router_bias) takes the softmax of the top-k logits (= our softmax
over all, renormalised). The experts are stored stacked, (in, out) as ours: gate_up_proj (E, d, 2f) interleaves
gate (even columns) and up (odd) = our gate_proj / up_proj, its bias likewise our gate_bias / up_bias;
down_proj / down_proj_bias = our down_proj / down_bias (expert_linear_bias). They apply the clamped SwiGLU
(swiglu_limit, swiglu_alpha = ours; hidden_act is unused). router_aux_loss_coef <-> moe_aux_loss.

Refused: layer_types other than every n-th block global, rotary scaling other than ours; on export, a model without
sinks, router bias or expert biases (gpt-oss always has them). The Hub's MXFP4 experts (*_blocks / *_scales,
quant_method mxfp4) are read dequantized (checkpointing/quantized.py); blocks without that quantization_config are
refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshformer.checkpointing.hf_adapter import ANY
from meshformer.config import ModelConfig, MoeConfig
from meshformer.model.config import attention_pattern
from meshformer.model.families.naming import Rule
from meshformer.models import llama_like

ARCH = "gpt_oss"
QUANTIZED = (r"_(blocks|scales)$", "the experts are stored quantized (MXFP4 blocks and scales), which meshformer "
             "dequantizes only from a folder whose config.json names them; add quantization_config "
             "{\"quant_method\": \"mxfp4\"} to config.json and import the folder")


def config_from_hf(c: Any) -> ModelConfig:
    kinds = list(c.layer_types)
    window = None if c.sliding_window is None or "sliding_attention" not in kinds else int(c.sliding_window)
    every = llama_like.full_attention_every(kinds, ARCH) if window is not None else None
    cfg = llama_like.config_from_hf(c, ARCH, window=False, hidden_act=False)  # the experts gate their own way
    return replace(
        cfg, bias=bool(c.attention_bias), layer_types=attention_pattern(window, every),
        attention=replace(cfg.attention, sinks=True, window=window),
        ffn=replace(cfg.ffn, activation="swiglu_clamped", swiglu_limit=float(c.swiglu_limit),
                    swiglu_alpha=float(c.swiglu_alpha)),
        moe=MoeConfig(n_experts=c.num_local_experts, experts_per_token=c.num_experts_per_tok, router_renormalize=True,
                      router_bias=True, expert_linear_bias=True, aux_loss=c.router_aux_loss_coef))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.GptOssConfig(
        **llama_like.fields_to_hf(cfg), intermediate_size=cfg.expert_d_ff, attention_bias=cfg.bias,
        sliding_window=cfg.attention.window, layer_types=llama_like.layer_types_to_hf(cfg),
        num_local_experts=cfg.moe.n_experts, num_experts_per_tok=cfg.moe.experts_per_token,
        swiglu_limit=cfg.ffn.swiglu_limit, swiglu_alpha=cfg.ffn.swiglu_alpha, router_aux_loss_coef=cfg.moe.aux_loss)


def experts(o: str, t: str, cfg: ModelConfig) -> list[Rule]:
    """An MoE block's router and its stacked experts, gate and up interleaved in one tensor."""
    ours, theirs = f"{o}.ffn", f"{t}.mlp"
    return [Rule((f"{ours}.router.weight",), f"{theirs}.router.weight"),
            Rule((f"{ours}.router.bias",), f"{theirs}.router.bias"),
            Rule((f"{ours}.experts.gate_proj", f"{ours}.experts.up_proj"), f"{theirs}.experts.gate_up_proj",
                 interleave=True),
            Rule((f"{ours}.experts.gate_bias", f"{ours}.experts.up_bias"), f"{theirs}.experts.gate_up_proj_bias",
                 interleave=True),
            Rule((f"{ours}.experts.down_proj",), f"{theirs}.experts.down_proj"),
            Rule((f"{ours}.experts.down_bias",), f"{theirs}.experts.down_proj_bias")]


ADAPTER = llama_like.adapter(
    ARCH, "GptOssForCausalLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    expresses=("ffn.swiglu_limit", "ffn.swiglu_alpha"), experts=experts,
    # its windowed blocks rotate with the global (scaled) RoPE, as ours do without rope_local_theta
    requirements={**llama_like.REQUIREMENTS, "activation": "swiglu_clamped", "bias": {False, True}, "moe": True,
                  "attention_sinks": True, "router_bias": True, "expert_linear_bias": True, "attention_window": ANY,
                  "full_attention_every": ANY, "windowed_blocks_rope": ANY},
    size_keys=(*llama_like.SIZE_KEYS, "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window"),
    refused_names=(QUANTIZED,),
)
