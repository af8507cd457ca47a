"""Encoder-decoder (original Transformer, T5): a bidirectional stack whose output the causal stack
cross-attends; span corruption or sequence-to-sequence.

Name maps: Hugging Face T5 (one relative-position bias per stack, kept in block 0's SelfAttention) and
torch.nn.Transformer (layers and final norms only; q/k/v packed in `in_proj_*`, cross-attention called
`multihead_attn`).
"""

from __future__ import annotations

from meshformer.model.config import ModelConfig
from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import Rule, norm, params
from meshformer.model.families.spec import Stack
from meshformer.model.flops import encoder_decoder_flops

# Each stack's depth: its own key, or model.n_layers when that is unset.
ENCODER = Stack("encoder", causal=False, depth_key="model.n_encoder_layers (or model.n_layers)",
                count=lambda cfg: cfg.n_layers if cfg.n_encoder_layers is None else cfg.n_encoder_layers)
DECODER = Stack("decoder", causal=True, cross=True, depth_key="model.n_decoder_layers (or model.n_layers)",
                count=lambda cfg: cfg.n_layers if cfg.n_decoder_layers is None else cfg.n_decoder_layers)


def t5_rules(cfg: ModelConfig) -> list[Rule]:
    rules = [Rule(("tok_embeddings.weight",), "shared.weight"),
             *[Rule(("tok_embeddings.weight",), name, alias=True)
               for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")],
             *norm("encoder_norm", "encoder.final_layer_norm", cfg),
             *norm("decoder_norm", "decoder.final_layer_norm", cfg),
             *[Rule((f"{stack}_relative_bias.relative_bias.weight",),
                    f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
               for stack in ("encoder", "decoder")]]

    def attention(ours: str, theirs: str) -> list[Rule]:
        return [r for p in "qkvo" for r in params(f"{ours}.{p}_proj", f"{theirs}.{p}", ("weight",))]

    def ffn(ours: str, theirs: str) -> list[Rule]:
        if cfg.ffn.activation == "swiglu":
            names = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"}
        else:
            names = {"up_proj": "wi", "down_proj": "wo"}
        return [r for a, b in names.items() for r in params(f"{ours}.{a}", f"{theirs}.{b}", ("weight",))]

    for i in range(ENCODER.count(cfg)):
        o, t = f"encoder_layers.{i}", f"encoder.block.{i}.layer"
        rules += [*norm(f"{o}.attn_norm", f"{t}.0.layer_norm", cfg), *attention(f"{o}.attn", f"{t}.0.SelfAttention"),
                  *norm(f"{o}.ffn_norm", f"{t}.1.layer_norm", cfg), *ffn(f"{o}.ffn", f"{t}.1.DenseReluDense")]
    for i in range(DECODER.count(cfg)):
        o, t = f"decoder_layers.{i}", f"decoder.block.{i}.layer"
        rules += [*norm(f"{o}.attn_norm", f"{t}.0.layer_norm", cfg), *attention(f"{o}.attn", f"{t}.0.SelfAttention"),
                  *norm(f"{o}.cross_norm", f"{t}.1.layer_norm", cfg),
                  *attention(f"{o}.cross_attn", f"{t}.1.EncDecAttention"),
                  *norm(f"{o}.ffn_norm", f"{t}.2.layer_norm", cfg), *ffn(f"{o}.ffn", f"{t}.2.DenseReluDense")]
    return rules


def torch_transformer_rules(cfg: ModelConfig) -> list[Rule]:
    names = ("weight", "bias") if cfg.bias else ("weight",)

    def attention(ours: str, theirs: str) -> list[Rule]:
        packed = (f"{ours}.q_proj", f"{ours}.k_proj", f"{ours}.v_proj")
        in_proj = [Rule(tuple(f"{p}.{n}" for p in packed), f"{theirs}.in_proj_{n}") for n in names]
        return in_proj + params(f"{ours}.o_proj", f"{theirs}.out_proj", names)

    def ffn(o: str, t: str, norm_index: int) -> list[Rule]:
        return [*params(f"{o}.ffn.up_proj", f"{t}.linear1", names),
                *params(f"{o}.ffn.down_proj", f"{t}.linear2", names),
                *params(f"{o}.ffn_norm", f"{t}.norm{norm_index}", names)]

    rules = params("encoder_norm", "encoder.norm", names) + params("decoder_norm", "decoder.norm", names)
    for i in range(ENCODER.count(cfg)):
        o, t = f"encoder_layers.{i}", f"encoder.layers.{i}"
        rules += [*attention(f"{o}.attn", f"{t}.self_attn"), *params(f"{o}.attn_norm", f"{t}.norm1", names),
                  *ffn(o, t, 2)]
    for i in range(DECODER.count(cfg)):
        o, t = f"decoder_layers.{i}", f"decoder.layers.{i}"
        rules += [*attention(f"{o}.attn", f"{t}.self_attn"), *params(f"{o}.attn_norm", f"{t}.norm1", names),
                  *attention(f"{o}.cross_attn", f"{t}.multihead_attn"),
                  *params(f"{o}.cross_norm", f"{t}.norm2", names), *ffn(o, t, 3)]
    return rules


SPEC = transformer_family(
    name="encoder_decoder",
    stacks=(ENCODER, DECODER),
    objectives=("span", "seq2seq"),
    training_flops=encoder_decoder_flops,
    name_maps={"t5": t5_rules, "torch.nn.Transformer": torch_transformer_rules},
)
