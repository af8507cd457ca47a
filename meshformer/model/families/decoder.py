"""Decoder-only (GPT, Llama): one causal stack; next-token prediction.

Name maps: Hugging Face GPT-2 (Conv1D weights stored (in, out), q/k/v packed in `c_attn`), Llama, Mistral,
Qwen2, Qwen3, OLMo 2, Gemma 2 and 3 (names only), Mixtral, Qwen3-MoE and OLMoE (one (out, in) linear per expert, as
their checkpoints store them); Megatron-Core GPTModel (checkpointing/megatron.py).
"""

from __future__ import annotations

from functools import partial

from meshformer.model.config import ModelConfig
from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import MegatronNames, Rule, expert_params, norm, params
from meshformer.model.families.spec import Stack
from meshformer.model.flops import decoder_flops
from meshformer.model.moe import is_moe_block


def gpt2_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [Rule(("tok_embeddings.weight",), "transformer.wte.weight"),
             Rule(("pos_embeddings.weight",), "transformer.wpe.weight"),
             Rule(("output.weight",), "lm_head.weight", alias=cfg.tie_embeddings),
             *norm("decoder_norm", "transformer.ln_f", cfg)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"transformer.h.{i}"
        rules += [*norm(f"{o}.attn_norm", f"{t}.ln_1", cfg), *norm(f"{o}.ffn_norm", f"{t}.ln_2", cfg),
                  *params(tuple(f"{o}.attn.{p}_proj" for p in "qkv"), f"{t}.attn.c_attn", transpose=True),
                  *params(f"{o}.attn.o_proj", f"{t}.attn.c_proj", transpose=True),
                  *params(f"{o}.ffn.up_proj", f"{t}.mlp.c_fc", transpose=True),
                  *params(f"{o}.ffn.down_proj", f"{t}.mlp.c_proj", transpose=True)]
    return rules


# An MoE block's router and expert j's gate / up / down linears, as each architecture's checkpoints name them.
_HF_EXPERTS = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts.{j}.", ("w1", "w3", "w2")),
               **dict.fromkeys(("qwen3_moe", "olmoe"), ("mlp.gate", "mlp.experts.{j}.", ("gate_proj", "up_proj",
                                                                                         "down_proj")))}


# Our block norms -> HF's names, by where the norms sit: Llama's pre-norms; OLMo 2's norms of the sub-layer outputs;
# Gemma's pre- and post-norms around each sub-layer.
_HF_BLOCK_NORMS = {
    "pre": (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")),
    "post_sublayer": (("attn_norm", "post_attention_layernorm"), ("ffn_norm", "post_feedforward_layernorm")),
    "sandwich": (("attn_norm", "input_layernorm"), ("attn_out_norm", "post_attention_layernorm"),
                 ("ffn_norm", "pre_feedforward_layernorm"), ("ffn_out_norm", "post_feedforward_layernorm")),
}


def llama_rules(cfg: ModelConfig, arch: str = "llama") -> list[Rule]:
    """Llama and the architectures that share its names: Mistral, Qwen2 (Q/K/V biases), Qwen3 (QK-norm), Mixtral
    and Qwen3-MoE (expert blocks), OLMo 2 and Gemma 2 / 3 (their block norms)."""
    linear = ("weight", "bias") if cfg.bias else ("weight",)
    qkv_linear = ("weight", "bias") if cfg.use_qkv_bias else ("weight",)
    rules = [Rule(("tok_embeddings.weight",), "model.embed_tokens.weight"), *norm("decoder_norm", "model.norm", cfg),
             Rule(("output.weight",), "lm_head.weight", alias=cfg.tie_embeddings)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"model.layers.{i}"
        for ours, theirs in _HF_BLOCK_NORMS[cfg.norm.position]:
            rules += norm(f"{o}.{ours}", f"{t}.{theirs}", cfg)
        for p in ("q", "k", "v", "o"):
            rules += params(f"{o}.attn.{p}_proj", f"{t}.self_attn.{p}_proj", linear if p == "o" else qkv_linear)
        if cfg.attention.qk_norm:
            rules += [Rule((f"{o}.attn.{p}_norm.weight",), f"{t}.self_attn.{p}_norm.weight") for p in "qk"]
        if is_moe_block(cfg, i):
            router, expert, (gate, up, down) = _HF_EXPERTS[arch]
            rules += [Rule((f"{o}.ffn.router.weight",), f"{t}.{router}.weight")]
            for ours, theirs in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                rules += expert_params(f"{o}.ffn.experts.{ours}", f"{t}.{expert}{theirs}.weight", cfg.moe.n_experts)
        else:
            for p in ("gate", "up", "down"):
                rules += params(f"{o}.ffn.{p}_proj", f"{t}.mlp.{p}_proj", linear)
    return rules


SPEC = transformer_family(
    name="decoder",
    stacks=(Stack("decoder", causal=True, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("causal",),
    training_flops=decoder_flops,
    name_maps={"gpt2": gpt2_rules, **{arch: partial(llama_rules, arch=arch)
                                      for arch in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
                                                   "olmoe", "olmo2", "gemma2", "gemma3_text")}},
    megatron=MegatronNames(
        model="GPTModel", layers="decoder_layers", embedding="tok_embeddings.weight",
        positions="pos_embeddings.weight", final_norm="decoder_norm", output="output.weight",
        attn_norm="attn_norm", ffn_norm="ffn_norm", qkv=("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        q_norm="attn.q_norm", k_norm="attn.k_norm", attn_out="attn.o_proj", gate="ffn.gate_proj",
        up="ffn.up_proj", down="ffn.down_proj", moe="ffn",
    ),
)
