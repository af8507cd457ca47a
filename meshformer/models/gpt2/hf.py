"""GPT-2 (GPT2LMHeadModel): Conv1D weights are stored (in, out), so they are transposed; `c_attn` packs q/k/v;
gelu_new is our "gelu_tanh"; learned positions, pre-norm, final norm `ln_f`, head tied to `wte`;
scale_attn_weights=False is our attention_scale=1.0. reorder_and_upcast_attn only computes the scores in fp32 (the
same function); scale_attn_by_inverse_layer_idx (a per-layer scale) and add_cross_attention are refused.
"""

from __future__ import annotations

from typing import Any

from meshformer.checkpointing.hf_adapter import COMMON, HFAdapter, features, refuse
from meshformer.config import Activation, AttentionConfig, FfnConfig, InitConfig, ModelConfig, NormConfig
from meshformer.model.families.naming import Rule, norm, params

HF_ACTIVATIONS: dict[str, Activation] = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                                         "relu": "relu"}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def activation(name: str, arch: str) -> Activation:
    if name not in HF_ACTIVATIONS:
        raise ValueError(f"{arch}: activation {name!r} has no meshformer equivalent — only checkpoints using one of "
                         f"{sorted(HF_ACTIVATIONS)} can be imported")
    return HF_ACTIVATIONS[name]


def rules(cfg: ModelConfig) -> list[Rule]:
    """Conv1D weights are stored (in, out): transposed; q / k / v packed in `c_attn`."""
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


def config_from_hf(c: Any) -> ModelConfig:
    if getattr(c, "scale_attn_by_inverse_layer_idx", False):
        raise refuse("gpt2", "scale_attn_by_inverse_layer_idx=True", "divides each layer's attention scores by "
                     "its depth")
    if getattr(c, "add_cross_attention", False):
        raise refuse("gpt2", "add_cross_attention=True", "adds cross-attention to every block")
    return ModelConfig(family="decoder", vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer,
                       position="learned", max_seq_len=c.n_positions, tie_embeddings=c.tie_word_embeddings, bias=True,
                       dropout=c.resid_pdrop,
                       attention=AttentionConfig(n_heads=c.n_head, dropout=c.attn_pdrop,
                                                 scale=None if getattr(c, "scale_attn_weights", True) else 1.0),
                       ffn=FfnConfig(d_ff=c.n_inner or 4 * c.n_embd,
                                     activation=activation(c.activation_function, "gpt2")),
                       norm=NormConfig(kind="layernorm", eps=c.layer_norm_epsilon, position="pre"),
                       init=InitConfig(std=c.initializer_range))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    special = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.attention.n_heads, n_inner=cfg.ffn.d_ff, activation_function=TO_HF_ACTIVATION[cfg.ffn.activation],
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attention.dropout,
        layer_norm_epsilon=cfg.norm.eps, initializer_range=cfg.init.std, bos_token_id=special,
        eos_token_id=special, tie_word_embeddings=cfg.tie_embeddings,
        scale_attn_weights=features(cfg)["attention_scale"] != 1.0,
    )


ADAPTER = HFAdapter(
    model_type="gpt2", model_class="GPT2LMHeadModel", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**COMMON, "family": "decoder", "position": "learned", "bias": True,
                  "activation": {"gelu_tanh", "gelu", "relu"}, "attention_scale": {"1/sqrt(head_dim)", 1.0}},
    rules=rules, base_prefix="transformer.",
    size_keys=("vocab_size", "n_embd", "n_head", "n_layer", "n_positions", "n_inner"), layer_keys=("n_layer",),
    width_and_heads=("n_embd", "n_head"), ignored=r"\.attn\.(masked_)?bias$",  # older files' causal-mask buffers
)
