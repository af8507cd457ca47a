"""Pipeline stages of a Transformer: split by layers, encoder layers first, then decoder layers.

A stage is a `TransformerStage`: a Transformer holding only its pieces (the others are None), under the
same attribute names, so parameter names match the plain model (`decoder_layers.5.attn.q_proj.weight`) for
checkpoints and parity checks, and the model's own `embed`/`head`/`_relative` do the work.

What travels between stages (positional tensors; the batch's ids and masks reach every stage as keyword
arguments, so masks, RoPE angles and ALiBi biases are rebuilt locally instead of being sent):
- decoder-only / encoder-only: the hidden states `h`;
- encoder-decoder: the first stage embeds *both* streams. Through the encoder stages `(h_enc, h_dec)` travel
  together (the embedded target rides along untouched); once the encoder ends, its output (`memory`) travels
  *with* the decoder stream, `(h_dec, memory)`, through every decoder stage: each stage's cross-attention
  reads it and passes it on, and in backward its gradient accumulates stage by stage on its way back to the
  encoder. Embedding the target on the first stage means no stage mixes a received, differentiable input
  with a parameter-only branch, a graph shape torch's zero-bubble weight pass cannot split (it re-runs a
  shared node and fails with "backward through the graph a second time").
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from meshformer.model import Transformer
from meshformer.model.masks import build_mask, masked_avg_pool, pool_padding_mask

# The T5 relative biases stay None in every stage: validate.py refuses position="t5_relative" with pp > 1.
PIECES = ("tok_embeddings", "src_embeddings", "pos_embeddings", "rope", "embedding_norm", "encoder_layers",
          "encoder_norm", "decoder_layers", "decoder_norm", "head_dense", "head_act", "head_norm", "output",
          "encoder_relative_bias", "decoder_relative_bias")


@dataclass(frozen=True)
class StageSpan:
    index: int
    n_stages: int
    start: int  # first global layer index (encoder layers are 0..E-1, decoder layers E..E+D-1)
    stop: int  # one past the last


def split_layers(n_layers: int, n_stages: int, split_points: list[int] | None = None) -> list[StageSpan]:
    """Contiguous layer ranges: even (earlier stages take the remainder) or at the given split points."""
    if split_points:
        bounds = [0, *split_points, n_layers]
    else:
        base, extra = divmod(n_layers, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    if len(bounds) != n_stages + 1 or any(b >= e for b, e in itertools.pairwise(bounds)):
        raise ValueError(f"cannot split {n_layers} layers into {n_stages} non-empty stages at {bounds[1:-1]}")
    return [StageSpan(s, n_stages, bounds[s], bounds[s + 1]) for s in range(n_stages)]


def stage_ids_for_rank(pp_rank: int, pp: int, stages_per_rank: int, v_shape: bool) -> list[int]:
    """Loop placement (rank r holds r, r+pp, ...) or the V of ZBV (rank r holds r and 2*pp-1-r)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def stage_pieces(model: Transformer, span: StageSpan) -> dict[str, nn.Module | None]:
    """The modules (shared with `model`, not copied) that the stage covering `span` needs."""
    cfg = model.cfg
    n_enc, n_dec = cfg.encoder_layers, cfg.decoder_layers
    enc = [i for i in range(n_enc) if span.start <= i < span.stop]
    dec = [j for j in range(n_dec) if span.start <= n_enc + j < span.stop]
    is_last = span.stop == n_enc + n_dec
    pieces: dict[str, nn.Module | None] = dict.fromkeys(PIECES)
    if span.index == 0:  # the first stage embeds every stream (enc-dec: source and target)
        if enc:
            source = "src_embeddings" if model.src_embeddings is not None else "tok_embeddings"
            pieces[source] = getattr(model, source)
        if cfg.family != "encoder":
            pieces["tok_embeddings"] = model.tok_embeddings
        pieces["pos_embeddings"], pieces["embedding_norm"] = model.pos_embeddings, model.embedding_norm
    pieces["rope"] = model.rope
    if enc:
        pieces["encoder_layers"] = nn.ModuleDict({str(i): model.encoder_layers[str(i)] for i in enc})
        if n_enc - 1 in enc:
            pieces["encoder_norm"] = model.encoder_norm
    if dec:
        pieces["decoder_layers"] = nn.ModuleDict({str(j): model.decoder_layers[str(j)] for j in dec})
        if n_dec - 1 in dec:
            pieces["decoder_norm"] = model.decoder_norm
    if is_last:
        for name in ("head_dense", "head_act", "head_norm", "output"):
            pieces[name] = getattr(model, name)
    return pieces


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name; a tied weight has one canonical name (tok_embeddings.weight)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


class TransformerStage(Transformer):
    """One pipeline stage: a Transformer that holds only the pieces of its layer range."""

    def __init__(self, model: Transformer, span: StageSpan) -> None:
        nn.Module.__init__(self)
        self.cfg, self.span, self.init_seed = model.cfg, span, model.init_seed
        pieces = stage_pieces(model, span)
        memo: dict[int, object] = {}
        # One deepcopy for all pieces: weights tied *within* the stage stay tied; every stage gets its own
        # copy of weights it shares with other stages (kept in sync by the plan's gradient all-reduce).
        copied = copy.deepcopy({k: v for k, v in pieces.items() if v is not None}, memo)
        for name in PIECES:
            setattr(self, name, copied.get(name))
        if model.alibi_slopes is not None:
            self.register_buffer("alibi_slopes", model.alibi_slopes.clone(), persistent=False)
        else:
            self.alibi_slopes = None
        # Full-model name of each of this stage's parameter names (they differ only for tied weights, e.g. the
        # last stage's output.weight is tok_embeddings.weight); keyed by name, which survives TP and FSDP.
        origin = {id(memo[pid]): name for pid, name in canonical_names(model).items() if pid in memo}
        self.canonical = {name: origin[id(p)] for name, p in self.named_parameters(remove_duplicate=False)}
        n_enc = model.cfg.encoder_layers
        self.has_encoder = self.encoder_layers is not None
        self.has_decoder = self.decoder_layers is not None
        self.ends_encoder = self.encoder_norm is not None or (self.has_encoder and str(n_enc - 1) in
                                                              self.encoder_layers)
        self.is_first, self.is_last = span.index == 0, span.index == span.n_stages - 1

    def forward(
        self,
        *stream: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        family = self.cfg.family
        if family == "decoder":
            return self._decoder(stream[0] if stream else None, input_ids, attention_mask, None, None)
        if family == "encoder":
            h = self._encoder(stream[0] if stream else None, input_ids, attention_mask)
            return self.head(h) if self.is_last else h
        return self._encoder_decoder(stream, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)

    def _encoder_decoder(self, stream, src_ids, src_padding, tgt_ids, tgt_padding):
        # Received tensors passed on unchanged are sent as copies: zero-bubble schedules detach stage outputs in
        # place, and a copy's backward hands the next stage's gradient back to this stage's input.
        memory = None
        if self.is_first:
            h_enc, h_dec = None, self.embed(tgt_ids)
        elif self.has_encoder:
            h_enc, h_dec = stream
            h_dec = h_dec.clone()
        else:
            h_dec, memory = stream
        if self.has_encoder:
            h_enc = self._encoder(h_enc, src_ids, src_padding)
            if not self.ends_encoder:
                return h_enc, h_dec
            memory = h_enc
        if not self.has_decoder:
            return h_dec, memory
        memory_padding = src_padding
        if src_padding is not None and self.cfg.cross_downsample > 1:
            memory_padding = pool_padding_mask(src_padding, self.cfg.cross_downsample)
        out = self._decoder(h_dec, tgt_ids, tgt_padding, memory, memory_padding)
        if self.is_last:
            return out
        return out, memory if self.has_encoder else memory.clone()

    def _encoder(self, h: torch.Tensor | None, ids: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        length = ids.shape[1]
        if h is None:
            h = self.embed(ids, source=True)
        mask = build_mask(length, length, causal=False, window=self.cfg.attention_window, key_padding=padding,
                          device=ids.device)
        extra = self._relative(length, length, 0, ids.device, causal=False)
        for layer in self.encoder_layers.values():
            h = layer(h, mask, **extra)
        if not self.ends_encoder:
            return h
        if self.encoder_norm is not None:
            h = self.encoder_norm(h)
        factor = self.cfg.cross_downsample
        if self.cfg.family == "encoder_decoder" and factor > 1:
            h = masked_avg_pool(h, padding, factor)
        return h

    def _decoder(
        self,
        h: torch.Tensor | None,
        ids: torch.Tensor,
        padding: torch.Tensor | None,
        memory: torch.Tensor | None,
        memory_padding: torch.Tensor | None,
    ) -> torch.Tensor:
        if not self.has_decoder:
            return h
        length = ids.shape[1]
        if h is None:
            h = self.embed(ids)
        mask = build_mask(length, length, causal=True, window=self.cfg.attention_window, key_padding=padding,
                          device=ids.device)
        memory_mask = None
        if memory is not None:
            memory_mask = build_mask(length, memory.shape[1], causal=False, key_padding=memory_padding,
                                     device=ids.device)
        extra = self._relative(length, length, 0, ids.device, causal=True)
        for layer in self.decoder_layers.values():
            h = layer(h, mask, memory=memory, memory_mask=memory_mask, **extra)
        if self.decoder_norm is not None:
            h = self.decoder_norm(h)
        return self.head(h) if self.is_last else h


def build_stages(model: Transformer, spans: list[StageSpan], stage_ids: list[int]) -> list[TransformerStage]:
    return [TransformerStage(model, spans[s]) for s in stage_ids]
