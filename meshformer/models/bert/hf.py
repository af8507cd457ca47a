"""BERT (BertForMaskedLM): post-norm, GELU (erf), embedding LayerNorm = our `embedding_norm`, MLM transform = our
`head_transform`, decoder bias = our `output_bias`. We have no token types: import folds `token_type_embeddings[0]`
into the position table (exact for token_type_ids = 0, HF's default); export writes zero token-type embeddings. The
pooler / NSP head are not part of BertForMaskedLM; TF-era checkpoints' LayerNorm gamma / beta are read too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from meshformer.checkpointing.hf_adapter import COMMON, Derived, HFAdapter, refuse
from meshformer.config import AttentionConfig, FfnConfig, InitConfig, ModelConfig, NormConfig
from meshformer.model.families.naming import Rule, norm, params
from meshformer.models.gpt2.hf import TO_HF_ACTIVATION, activation

POSITIONS = "bert.embeddings.position_embeddings.weight"
TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"


def rules(cfg: ModelConfig) -> list[Rule]:
    # The position table is `Derived` (below): ours = positions + token_type[0].
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


def config_from_hf(c: Any) -> ModelConfig:
    position = getattr(c, "position_embedding_type", None) or "absolute"
    if position != "absolute":
        raise refuse("bert", f"position_embedding_type={position!r}", "uses relative position scores")
    if c.is_decoder or getattr(c, "add_cross_attention", False):
        raise refuse("bert", "is_decoder/add_cross_attention", "makes attention causal or adds cross-attention")
    return ModelConfig(family="encoder", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
                       head_transform=True, output_bias=True, position="learned", max_seq_len=c.max_position_embeddings,
                       tie_embeddings=c.tie_word_embeddings, bias=True, dropout=c.hidden_dropout_prob,
                       attention=AttentionConfig(n_heads=c.num_attention_heads, dropout=c.attention_probs_dropout_prob),
                       ffn=FfnConfig(d_ff=c.intermediate_size, activation=activation(c.hidden_act, "bert")),
                       norm=NormConfig(kind="layernorm", eps=c.layer_norm_eps, position="post", final=False,
                                       embedding=True), init=InitConfig(std=c.initializer_range))


def config_to_hf(cfg: ModelConfig) -> Any:
    import transformers

    return transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.attention.n_heads, intermediate_size=cfg.ffn.d_ff,
        hidden_act=TO_HF_ACTIVATION[cfg.ffn.activation], hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attention.dropout, max_position_embeddings=cfg.max_seq_len,
        layer_norm_eps=cfg.norm.eps, initializer_range=cfg.init.std, tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=0,
    )


def _positions_from_hf(theirs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return theirs[POSITIONS] + (theirs[TOKEN_TYPES][0] if TOKEN_TYPES in theirs else 0.0)


def _positions_to_hf(positions: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # BertConfig's type_vocab_size is 2
    return {POSITIONS: positions, TOKEN_TYPES: positions.new_zeros(2, cfg.d_model)}


_OLD_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


def _old_names(name: str) -> str:
    return re.sub(r"LayerNorm\.(gamma|beta)$", lambda m: _OLD_NAMES[m.group(0)], name)


ADAPTER = HFAdapter(
    model_type="bert", model_class="BertForMaskedLM", config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    requirements={**COMMON, "family": "encoder", "position": "learned", "bias": True, "norm_position": "post",
                  "final_norm": False, "embedding_norm": True, "head_transform": True, "output_bias": True,
                  "activation": {"gelu_tanh", "gelu", "relu"}},
    rules=rules, base_prefix="bert.", keep_prefix=("lm_head.", "cls."),
    size_keys=("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
               "max_position_embeddings"),
    layer_keys=("num_hidden_layers",), width_and_heads=("hidden_size", "num_attention_heads"),
    derived=(Derived("pos_embeddings.weight", (POSITIONS, TOKEN_TYPES), _positions_from_hf, _positions_to_hf),),
    # the pooler and next-sentence head (not part of BertForMaskedLM), the token-type ids buffer
    ignored=r"^(bert\.pooler\.|cls\.seq_relationship\.)|token_type_ids$", old_names=_old_names,
)
