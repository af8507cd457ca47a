"""Encoder-only (BERT): one bidirectional stack; masked-token prediction.

Name map: Hugging Face BERT (BertForMaskedLM); its position table also absorbs token type 0, which
checkpointing/hf.py folds in and out.
"""

from __future__ import annotations

from meshformer.model.config import ModelConfig
from meshformer.model.families.common import transformer_family
from meshformer.model.families.naming import Rule, norm, params
from meshformer.model.families.spec import Stack
from meshformer.model.flops import encoder_flops


def bert_rules(cfg: ModelConfig) -> list[Rule]:
    # The position table is handled in checkpointing/hf.py: ours = positions + token_type[0].
    rules = [Rule(("tok_embeddings.weight",), "bert.embeddings.word_embeddings.weight"),
             *norm("embedding_norm", "bert.embeddings.LayerNorm", cfg),
             *params("head_dense", "cls.predictions.transform.dense"),
             *norm("head_norm", "cls.predictions.transform.LayerNorm", cfg),
             Rule(("output.bias",), "cls.predictions.bias"),
             Rule(("output.bias",), "cls.predictions.decoder.bias", alias=True)]
    rules.append(Rule(("output.weight",), "cls.predictions.decoder.weight", alias=cfg.tie_embeddings))
    for i in range(cfg.n_layers):
        o, t = f"encoder_layers.{i}", f"bert.encoder.layer.{i}"
        rules += [*params(f"{o}.attn.q_proj", f"{t}.attention.self.query"),
                  *params(f"{o}.attn.k_proj", f"{t}.attention.self.key"),
                  *params(f"{o}.attn.v_proj", f"{t}.attention.self.value"),
                  *params(f"{o}.attn.o_proj", f"{t}.attention.output.dense"),
                  *norm(f"{o}.attn_norm", f"{t}.attention.output.LayerNorm", cfg),
                  *params(f"{o}.ffn.up_proj", f"{t}.intermediate.dense"),
                  *params(f"{o}.ffn.down_proj", f"{t}.output.dense"),
                  *norm(f"{o}.ffn_norm", f"{t}.output.LayerNorm", cfg)]
    return rules


SPEC = transformer_family(
    name="encoder",
    stacks=(Stack("encoder", causal=False, count=lambda cfg: cfg.n_layers, depth_key="model.n_layers"),),
    objectives=("mlm",),
    training_flops=encoder_flops,
    name_maps={"bert": bert_rules},
)
