"""Feed-forward networks and the Transformer block (encoder, decoder, or decoder with cross-attention)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from meshformer.model.attention import KVCache, SequenceChunk
from meshformer.model.components import TOKEN_MIXERS, block_mixers, channel_mixer, cross_mixer, token_mixer
from meshformer.model.components.base import Carry, GenerationCache
from meshformer.model.config import ModelConfig
from meshformer.model.masks import AttentionMask
from meshformer.model.norms import make_norm
from meshformer.model.residual import residual_kind


class SquaredReLU(nn.Module):
    """relu(x)² (Primer; Nemotron-H's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))


def activation_fn(name: str) -> nn.Module:
    """The one-input activation `name` (a gated one's activation of the gate)."""
    return {"relu": nn.ReLU(), "relu2": SquaredReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"),
            "swiglu": nn.SiLU(), "geglu": nn.GELU(approximate="tanh"), "swiglu_clamped": nn.SiLU(),
            "swiglu_limited": nn.SiLU()}[name]


class GatedUnit(nn.Module):
    """act(gate) * up: SwiGLU (Llama), GeGLU (Gemma)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated unit: gate clamped to <= limit, up to [-limit, limit], then (up + 1) * gate *
    sigmoid(alpha * gate). Zero at gate = up = 0, as every gated unit here (padded expert rows stay zero)."""

    def __init__(self, limit: float, alpha: float) -> None:
        super().__init__()
        self.limit, self.alpha = limit, alpha

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)


class LimitedSwiGLU(nn.Module):
    """DeepSeek-V4's gated unit: silu(gate) * up with gate clamped to <= limit and up to [-limit, limit] (bounded
    activations for low-precision experts). Zero at gate = up = 0."""

    def __init__(self, limit: float) -> None:
        super().__init__()
        self.limit = limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)


def feed_forward_unit(cfg: ModelConfig) -> nn.Module:
    """What sits between a feed-forward's input and output projections: the activation of the hidden units, or
    for a gated activation a module of (gate, up) -> hidden."""
    if cfg.ffn.activation == "swiglu_clamped":
        return ClampedSwiGLU(cfg.ffn.swiglu_limit, cfg.ffn.swiglu_alpha)
    if cfg.ffn.activation == "swiglu_limited":
        return LimitedSwiGLU(cfg.ffn.swiglu_limit)
    act = activation_fn(cfg.ffn.activation)
    return GatedUnit(act) if cfg.gated else act


class FeedForward(nn.Module):
    """d_model -> d_ff -> d_model; gated activations add a gate projection: down(unit(gate(x), up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn.d_ff, bias=cfg.bias) if cfg.gated else None
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn.d_ff, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.ffn.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = feed_forward_unit(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
        return self.down_proj(self.act(self.up_proj(x)))


@dataclass
class BlockCache:
    """A block's generation state: its token mixer's and its cross-attention's (`TokenMixer.new_cache`)."""

    self_attn: GenerationCache = field(default_factory=KVCache)
    cross_attn: GenerationCache = field(default_factory=KVCache)


class TransformerBlock(nn.Module):
    """A token mixer, the cross-attention of a cross-attending stack, a channel mixer (model/components/); each a
    branch joined to the stream by the residual kind's join (model/residual.py) with its norms and dropout."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False, index: int = 0) -> None:
        """index: the block's place in its stack (from 0), which picks its kinds (model.layer_types, mlp_types)."""
        super().__init__()
        residual = residual_kind(cfg)
        position = cfg.block_norm_position(index)  # model.norm.by_kind may set it per token-mixer kind
        sandwich = position == "sandwich"
        # attribute -> kind name: what tensor parallel and the generation cache read of this block
        self.mixers = {attribute: kind.name for attribute, kind in block_mixers(cfg, index, cross=cross).items()}
        mixer, ffn = token_mixer(cfg, index), channel_mixer(cfg, index)
        # a kind that is `empty` (`none`) leaves its sub-layer out: no module, norms or residual branch
        self.attn_norm = None if mixer.empty else make_norm(cfg)
        self.attn = None if mixer.empty else mixer.build(cfg, causal=causal)
        self.attn_reads_padding = mixer.reads_padding_and_documents
        self.attn_reads_carry, self.index = mixer.reads_carry, index
        self.attn_out_norm = make_norm(cfg) if sandwich and not mixer.empty else None
        self.attn_residual = None if mixer.empty else residual.branch(cfg, position)
        self.cross_norm = make_norm(cfg) if cross else None
        self.cross_attn = cross_mixer().build(cfg, causal=False) if cross else None
        self.cross_out_norm = make_norm(cfg) if cross and sandwich else None
        self.cross_residual = residual.branch(cfg, position) if cross else None
        self.ffn_norm = None if ffn.empty else make_norm(cfg)
        self.ffn = None if ffn.empty else ffn.build(cfg)
        self.ffn_reads_ids = ffn.reads_token_ids
        self.ffn_out_norm = make_norm(cfg) if sandwich and not ffn.empty else None
        self.ffn_residual = None if ffn.empty else residual.branch(cfg, position)

    def new_cache(self) -> BlockCache:
        """An empty generation cache for this block, as its token mixers declare it."""
        caches = {attribute: TOKEN_MIXERS[kind].new_cache() for attribute, kind in self.mixers.items()
                  if kind in TOKEN_MIXERS}
        return BlockCache(caches.get("attn") or KVCache(), caches.get("cross_attn") or KVCache())

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        *,
        memory: torch.Tensor | None = None,
        memory_mask: AttentionMask | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
        cache: BlockCache | None = None,
        chunk: SequenceChunk | None = None,
        padding: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        query_scale: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        carry: Carry | None = None,
    ) -> torch.Tensor:
        """chunk: under context parallel, the pieces of the sequence `x` holds (self-attention gathers the rest).
        padding, documents (B, T): x's tokens' padding and packed documents, for a token mixer whose kind reads them
        (`reads_padding_and_documents`; attention reads `mask`). query_scale: the queries' per-position multiplier
        (model.mla.query_scale_beta), passed only where set. token_ids (B, T): x's tokens, for a channel mixer whose
        kind reads them (`reads_token_ids`). carry: what the blocks of this forward hand on, for a token mixer whose
        kind reads it (`reads_carry`)."""
        tokens: dict[str, Any] = {"padding": padding, "documents": documents} if self.attn_reads_padding else {}
        if query_scale is not None:
            tokens["query_scale"] = query_scale
        if self.attn_reads_carry:
            tokens["carry"], tokens["block"] = carry, self.index
        if self.attn is not None and self.attn_norm is not None and self.attn_residual is not None:
            x = self.attn_residual(x, self.attn_norm, self.attn_out_norm, self.attn, mask, rope=rope, bias=bias,
                                   cache=cache.self_attn if cache else None, chunk=chunk, **tokens)
        if self.cross_attn is not None and self.cross_norm is not None and self.cross_residual is not None:
            x = self.cross_residual(x, self.cross_norm, self.cross_out_norm, self.cross_attn, memory_mask,
                                    memory=memory, cache=cache.cross_attn if cache else None)
        if self.ffn is None or self.ffn_norm is None or self.ffn_residual is None:
            return x
        ids = {"token_ids": token_ids} if self.ffn_reads_ids else {}
        return self.ffn_residual(x, self.ffn_norm, self.ffn_out_norm, self.ffn, **ids)
