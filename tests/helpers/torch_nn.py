"""Weights between `torch.nn.Transformer` and meshformer's encoder-decoder stacks.

nn.Transformer has no embeddings, positions or output head: only the layer stacks and the final
encoder/decoder norms it always adds (our `final_norm=True`). nn.MultiheadAttention packs q/k/v
into `in_proj_weight` (rows q, then k, then v) and names the decoder's cross-attention `multihead_attn`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshformer.checkpointing.mapping import export_tensors, import_tensors, name_map, our_shapes
from meshformer.config import Activation, AttentionConfig, FfnConfig, ModelConfig, NormConfig
from meshformer.model import Transformer

TORCH_TRANSFORMER = "torch.nn.Transformer"  # its name map lives in model/families/encoder_decoder.py
# Our tensors nn.Transformer does not have: left untouched by `load_torch_transformer`.
_OURS_ONLY = ("tok_embeddings.", "src_embeddings.", "pos_embeddings.", "output.")


def config_from_torch_transformer(module: nn.Transformer, vocab_size: int = 1) -> ModelConfig:
    """The encoder-decoder ModelConfig with the layer structure of `module` (no positions, no scaling)."""
    encoder_layer = module.encoder.layers[0]
    kinds: dict[int, Activation] = {1: "relu", 2: "gelu"}  # nn.TransformerEncoderLayer's own code for its activation
    if encoder_layer.activation_relu_or_gelu not in kinds:
        raise ValueError("only ReLU and GELU activations of nn.Transformer are supported")
    if module.encoder.norm is None or module.decoder.norm is None:
        raise ValueError("expected nn.Transformer's final encoder and decoder norms")
    return ModelConfig(family="encoder_decoder", vocab_size=vocab_size, d_model=module.d_model,
                       n_encoder_layers=len(module.encoder.layers), n_decoder_layers=len(module.decoder.layers),
                       position="none", scale_embeddings=False, bias=encoder_layer.linear1.bias is not None,
                       dropout=encoder_layer.dropout.p, attention=AttentionConfig(n_heads=module.nhead),
                       ffn=FfnConfig(d_ff=encoder_layer.linear1.out_features,
                                     activation=kinds[encoder_layer.activation_relu_or_gelu]),
                       norm=NormConfig(kind="layernorm", eps=encoder_layer.norm1.eps,
                                       position="pre" if encoder_layer.norm_first else "post", final=True))


def from_torch_transformer_state_dict(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our layer and final-norm tensors (no embeddings or head) from an nn.Transformer state dict."""
    out, used = import_tensors(state, name_map(cfg, TORCH_TRANSFORMER), our_shapes(cfg), "nn.Transformer")
    leftovers = sorted(set(state) - used)
    if leftovers:
        raise ValueError(f"nn.Transformer tensors with no meshformer counterpart: {leftovers[:8]}")
    return out


def to_torch_transformer_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    return export_tensors(model.state_dict(), name_map(model.cfg, TORCH_TRANSFORMER))


def load_torch_transformer(model: Transformer, module: nn.Transformer) -> None:
    """Copy `module`'s layers and final norms into our encoder-decoder `model`; embeddings and head stay."""
    result = model.load_state_dict(from_torch_transformer_state_dict(module.state_dict(), model.cfg), strict=False)
    unexpected_missing = [k for k in result.missing_keys if not k.startswith(_OURS_ONLY)]
    if unexpected_missing or result.unexpected_keys:
        raise ValueError(f"layer structure mismatch: missing {unexpected_missing}, unexpected {result.unexpected_keys}")
