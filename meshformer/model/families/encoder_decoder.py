"""Encoder-decoder (original Transformer, T5): a bidirectional stack whose output the causal stack
cross-attends; span corruption or sequence-to-sequence.

Name map: torch.nn.Transformer (layers and final norms only; q/k/v packed in `in_proj_*`, cross-attention called
`multihead_attn`); Hugging Face T5's lives in meshformer/models/t5/.
"""

from __future__ import annotations

from meshformer.model.config import ModelConfig
from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import Rule, params
from meshformer.model.families.spec import Stack
from meshformer.model.flops import encoder_decoder_flops

# Each stack's depth: its own key, or model.n_layers when that is unset.
ENCODER = Stack("encoder", causal=False, depth_key="model.n_encoder_layers (or model.n_layers)",
                count=lambda cfg: cfg.n_layers if cfg.n_encoder_layers is None else cfg.n_encoder_layers)
DECODER = Stack("decoder", causal=True, cross=True, depth_key="model.n_decoder_layers (or model.n_layers)",
                count=lambda cfg: cfg.n_layers if cfg.n_decoder_layers is None else cfg.n_decoder_layers)


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
    name_maps={"torch.nn.Transformer": torch_transformer_rules},  # Hugging Face T5's: meshformer/models/t5/
)
