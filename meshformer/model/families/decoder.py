"""Decoder-only (GPT, Llama): one causal stack; next-token prediction.

Name maps: Hugging Face GPT-2 (Conv1D weights stored (in, out), q/k/v packed in `c_attn`) and Llama (names
only); Megatron-Core GPTModel (checkpointing/megatron.py).
"""

from __future__ import annotations

from meshformer.model.config import ModelConfig
from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import MegatronNames, Rule, norm, params
from meshformer.model.families.spec import Stack
from meshformer.model.flops import decoder_flops


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


def llama_rules(cfg: ModelConfig) -> list[Rule]:
    linear = ("weight", "bias") if cfg.bias else ("weight",)
    rules = [Rule(("tok_embeddings.weight",), "model.embed_tokens.weight"), *norm("decoder_norm", "model.norm", cfg),
             Rule(("output.weight",), "lm_head.weight", alias=cfg.tie_embeddings)]
    for i in range(cfg.n_layers):
        o, t = f"decoder_layers.{i}", f"model.layers.{i}"
        rules += [*norm(f"{o}.attn_norm", f"{t}.input_layernorm", cfg),
                  *norm(f"{o}.ffn_norm", f"{t}.post_attention_layernorm", cfg)]
        for p in ("q", "k", "v", "o"):
            rules += params(f"{o}.attn.{p}_proj", f"{t}.self_attn.{p}_proj", linear)
        for p in ("gate", "up", "down"):
            rules += params(f"{o}.ffn.{p}_proj", f"{t}.mlp.{p}_proj", linear)
    return rules


SPEC = transformer_family(
    name="decoder",
    stacks=(Stack("decoder", causal=True, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("causal",),
    training_flops=decoder_flops,
    name_maps={"gpt2": gpt2_rules, "llama": llama_rules},
    megatron=MegatronNames(
        model="GPTModel", layers="decoder_layers", embedding="tok_embeddings.weight",
        positions="pos_embeddings.weight", final_norm="decoder_norm", output="output.weight",
        attn_norm="attn_norm", ffn_norm="ffn_norm", qkv=("attn.q_proj", "attn.k_proj", "attn.v_proj"),
        attn_out="attn.o_proj", gate="ffn.gate_proj", up="ffn.up_proj", down="ffn.down_proj",
    ),
)
