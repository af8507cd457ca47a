"""One building kit, three assemblies: decoder-only (GPT), encoder-only (BERT), encoder-decoder (original/T5).

Plain single-device PyTorch; which stacks a model has comes from its family's spec (model/families/).
Stacks are `nn.ModuleDict`s keyed "0", "1", ... so a pipeline split can delete layers and keep parameter
names; every piece may be None, and `forward` runs whatever pieces are present, so a pipeline stage is this
module built for a `StageSpan`, holding only its pieces (parallel/pipeline/stages.py adds only the packing of its
streams). What a part knows about the parallel layout is its `ParallelContext` (model/parallel_context.py).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshformer.model.components import model_kinds
from meshformer.model.components.base import Carry
from meshformer.model.config import ModelConfig
from meshformer.model.families import FamilySpec, get_family_spec
from meshformer.model.init import init_weights, new_seed
from meshformer.model.layers import BlockCache, TransformerBlock, activation_fn, make_norm
from meshformer.model.masks import AttentionMask, build_mask, masked_avg_pool, pool_padding_mask
from meshformer.model.moe import MoEFeedForward
from meshformer.model.mtp import HyperMtpModule, MtpModule, ahead_inputs, block_kinds, mtp_modules
from meshformer.model.parallel_context import ParallelContext, StageSpan
from meshformer.model.positions import (
    LearnedPositions,
    RelativePositionBias,
    RopeScaling,
    RotaryEmbedding,
    SinusoidalPositions,
    alibi_bias,
    alibi_slopes,
    query_scale,
)
from meshformer.model.residual import residual_kind

if TYPE_CHECKING:
    from meshformer.loss.fused import HeadLoss

# Every top-level piece a Transformer may hold; each may be None (not in the family or the config, or
# held by another pipeline stage).
PIECES = ("tok_embeddings", "src_embeddings", "pos_embeddings", "rope", "local_rope", "embedding_norm",
          "encoder_relative_bias", "decoder_relative_bias", "encoder_layers", "encoder_merge", "encoder_norm",
          "decoder_layers", "decoder_merge", "decoder_norm", "head_dense", "head_act", "head_norm", "output",
          "mtp_layers")


@dataclass(frozen=True)
class Streams:
    """Hidden states part-way through the model (what one pipeline stage hands the next)."""

    encoder: torch.Tensor | None = None  # inside the encoder stack
    decoder: torch.Tensor | None = None  # inside the decoder stack, or its embedded input waiting for it
    memory: torch.Tensor | None = None  # the finished encoder output


def tied_weights(cfg: ModelConfig) -> dict[str, str]:
    """Second names of the weights a model ties -> their first (canonical) name; a pipeline stage holding only the
    second piece holds its own copy under the second name."""
    return {"output.weight": "tok_embeddings.weight"} if cfg.tie_embeddings else {}


def stage_holdings(spec: FamilySpec, cfg: ModelConfig, span: StageSpan | None) -> tuple[set[str], dict[str, list[str]]]:
    """(top-level pieces, block keys per stack) of the part covering `span`; everything when `span` is None.

    Which pieces a stage holds besides its blocks is the family spec's `pipeline` (`StagePieces`); a stack's final norm
    goes with its last block, as does the residual's merge.
    """
    blocks = {stack.layers: [str(i) for i in range(stack.count(cfg))] for stack in spec.stacks}
    if span is None:
        return set(PIECES), blocks
    pieces = spec.pipeline
    held = {*pieces.every, *(pieces.first if span.index == 0 else ())}
    offset = 0
    for stack in spec.stacks:
        keys = [k for k in blocks[stack.layers] if span.start <= offset + int(k) < span.stop]
        blocks[stack.layers] = keys
        if keys:
            held.add(stack.layers)
            if keys[-1] == str(stack.count(cfg) - 1):
                held.update((stack.norm, stack.merge))
        offset += stack.count(cfg)
    if span.stop == offset:
        held.update(pieces.last)
        if cfg.mtp.depth and spec.has_decoder and not spec.seq2seq:
            # multi-token prediction beside the head, embedding the tokens ahead with its own copy of the embedding
            # (its gradient summed with the first stage's, as a tied embedding's)
            held.update(("mtp_layers", *(name for name in pieces.first if name != "src_embeddings")))
    return held, blocks


def freeze_all_but(model: nn.Module, trained: set[str]) -> None:
    """With `trained` (module names a kind's `trains_only` declares), only the parameters of modules so named train:
    every other parameter is frozen (requires_grad False: no gradient, no optimizer state)."""
    if not trained:
        return
    for name, param in model.named_parameters():
        param.requires_grad_(any(part in trained for part in name.split(".")[:-1]))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, init_seed: int | None = None, span: StageSpan | None = None) -> None:
        """The whole model, or with `span` one pipeline stage of it: the same module holding only that stage's
        pieces (the others None), under the whole model's attribute names."""
        super().__init__()
        self.cfg = cfg
        self.span = span
        # The layout this part runs under; parallel code changes it only through `set_parallel_context`.
        self.parallel_context = ParallelContext()
        # Every weight follows from init_seed (meshformer.model.init). By default it is drawn first from the global
        # CPU RNG, so torch.manual_seed(s) fixes every weight; a model built on the meta device (for shapes and
        # names, or to be materialised later) draws nothing unless given a seed, leaving the RNG stream alone.
        if init_seed is None and torch.get_default_device().type != "meta":
            init_seed = new_seed()
        self.init_seed = init_seed
        spec = self.spec
        held, blocks = stage_holdings(spec, cfg, span)
        has_encoder, has_decoder = spec.has_encoder, spec.has_decoder
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if "tok_embeddings" in held else None
        separate_source = spec.seq2seq and not cfg.share_embeddings and "src_embeddings" in held
        self.src_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model) if separate_source else None
        self.pos_embeddings: nn.Module | None = None
        if cfg.position == "learned" and "pos_embeddings" in held:
            self.pos_embeddings = LearnedPositions(cfg.max_seq_len, cfg.d_model)
        elif cfg.position == "sinusoidal" and "pos_embeddings" in held:
            self.pos_embeddings = SinusoidalPositions(cfg.max_seq_len, cfg.d_model)
        self.rope = (RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope.theta,
                                     RopeScaling.from_config(cfg))
                     if cfg.position == "rope" and "rope" in held else None)
        # the windowed blocks' own unscaled rotation (Gemma 3: base 10k locally, 1M globally)
        self.local_rope = (RotaryEmbedding(cfg.rope_dim, cfg.max_seq_len, cfg.rope.local_theta)
                           if cfg.position == "rope" and cfg.rope.local_theta is not None and "local_rope" in held
                           else None)
        if cfg.position == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(cfg.attention.n_heads), persistent=False)
        else:
            self.alibi_slopes = None
        # T5: one learned bias per stack (bidirectional in the encoder, causal in the decoder), shared by its layers;
        # cross-attention gets none.
        self.encoder_relative_bias: RelativePositionBias | None = None
        self.decoder_relative_bias: RelativePositionBias | None = None
        if cfg.position == "t5_relative":
            shape = (cfg.attention.n_heads, cfg.attention.relative_buckets, cfg.attention.relative_max_distance)
            if has_encoder and "encoder_relative_bias" in held:
                self.encoder_relative_bias = RelativePositionBias(*shape, bidirectional=True)
            if has_decoder and "decoder_relative_bias" in held:
                self.decoder_relative_bias = RelativePositionBias(*shape, bidirectional=False)
        self.embedding_norm = make_norm(cfg) if cfg.norm.embedding and "embedding_norm" in held else None

        self.encoder_layers: nn.ModuleDict | None = None
        self.decoder_layers: nn.ModuleDict | None = None
        self.encoder_norm: nn.Module | None = None
        self.decoder_norm: nn.Module | None = None
        self.encoder_merge: nn.Module | None = None
        self.decoder_merge: nn.Module | None = None
        self.residual = residual_kind(cfg)
        for stack in spec.stacks:
            if stack.layers in held:
                keys = blocks[stack.layers]
                setattr(self, stack.layers, nn.ModuleDict(
                    {key: TransformerBlock(cfg, causal=stack.causal, cross=stack.cross, index=int(key))
                     for key in keys}))
            setattr(self, stack.norm, make_norm(cfg) if cfg.use_final_norm and stack.norm in held else None)
            setattr(self, stack.merge, self.residual.merge(cfg) if stack.merge in held else None)
        self.head_dense: nn.Module | None = None
        self.head_act: nn.Module | None = None
        self.head_norm: nn.Module | None = None
        if cfg.head_transform and "head_dense" in held:  # BERT's prediction head: dense -> activation -> norm
            self.head_dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
            self.head_act = activation_fn(cfg.ffn.activation)
            self.head_norm = make_norm(cfg)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.output_bias) if "output" in held else None
        # multi-token prediction (model/mtp.py) beside the output head it shares
        self.mtp_layers = mtp_modules(cfg) if "mtp_layers" in held and spec.has_decoder and not spec.seq2seq else None
        if cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight  # tied_weights(cfg) names this tie
        spec.init(self)
        freeze_all_but(self, {name for kind in model_kinds(cfg) if (name := kind.trains_only(cfg))})

    def hold_copies_of(self, model: Transformer) -> None:
        """Swap this part's pieces for copies of `model`'s (values, dtype and device as they are there), and its
        top-level buffers and parallel context for `model`'s: how a pipeline stage takes its share of a model.

        One deepcopy for all pieces: weights tied *within* this part stay tied; a weight this part shares with
        another part is a copy of its own.
        """
        sources: dict[str, nn.Module] = {}
        for name in PIECES:
            mine = getattr(self, name)
            if mine is None:
                continue
            theirs = getattr(model, name)
            sources[name] = nn.ModuleDict({k: theirs[k] for k in mine}) if isinstance(mine, nn.ModuleDict) else theirs
        for name, module in copy.deepcopy(sources).items():
            setattr(self, name, module)
        for name, buffer in model.named_buffers(recurse=False):
            self.register_buffer(name, buffer.clone(), persistent=name not in model._non_persistent_buffers_set)
        self.parallel_context = model.parallel_context

    def set_parallel_context(self, context: ParallelContext) -> None:
        """The one way parallel code tells this model (or stage) its layout; the ALiBi slopes follow the heads, the
        MoE layers take the token group."""
        self.parallel_context = context
        self.reset_buffers()
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.token_group = context.token_group

    def canonical_name(self, name: str) -> str:
        """The whole model's name of this part's parameter `name` (a stage's copy of a tied weight has the
        tie's first name): what initialisation, checkpoints and shared-weight gradients key by."""
        return tied_weights(self.cfg).get(name, name)

    def canonical_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(canonical name, parameter) of every parameter object once; a tied weight by its first name."""
        seen: set[int] = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield self.canonical_name(name), param

    @property
    def spec(self) -> FamilySpec:
        return get_family_spec(self.cfg.family)

    # ------------------------------------------------------------------ initialisation

    def init_weights(self) -> None:
        """Every weight from `init_seed` and its name alone (meshformer.model.init); a no-op on the meta device."""
        if self.init_seed is None:
            if any(not p.is_meta for p in self.parameters()):
                raise ValueError("this model was built on the meta device without init_seed, so it cannot be "
                                 "initialised; build it with Transformer(cfg, init_seed=...) or load weights into it")
            return
        init_weights(self.canonical_parameters(), self.cfg, self.init_seed)

    def reset_parameters(self) -> None:
        self.init_weights()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the ALiBi slopes where they live (this rank's heads under tensor parallel)."""
        if self.alibi_slopes is not None:
            heads = self.cfg.attention.n_heads
            slopes = alibi_slopes(heads, self.alibi_slopes.device)[self.parallel_context.alibi_heads]
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    # ------------------------------------------------------------------ pieces

    def embed(self, ids: torch.Tensor, *, source: bool = False, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ absolute position) embeddings; `positions` of the ids in their sequence (default 0, 1, ...)."""
        table = self.src_embeddings if source and self.src_embeddings is not None else self.tok_embeddings
        if table is None:
            raise ValueError("this pipeline stage holds no embeddings to embed with")
        h = table(ids)
        if self.cfg.scale_embeddings:  # the factor rounded to the model dtype first, as Gemma scales
            h = h * torch.tensor(math.sqrt(self.cfg.d_model), dtype=torch.float32).to(h.dtype)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(torch.arange(ids.shape[1], device=ids.device) if positions is None
                                        else positions)
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        return nn.functional.dropout(h, self.cfg.dropout, self.training)

    def _hidden(self, ids: torch.Tensor, h: torch.Tensor | None, **embed_kwargs) -> torch.Tensor:
        """`h` if given, else `ids` embedded and entered into the residual stream; a model built without embeddings
        reads `ids` as hidden states."""
        if h is not None:
            return h
        return self.residual.enter(self.cfg, self.embed(ids, **embed_kwargs) if self.tok_embeddings is not None
                                   else ids)

    def _positions(self, q_len: int, offset: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """(positions of these q_len tokens, keys attention sees): offset.. after a KV cache; under context parallel
        this rank's pieces (attention splits by piece) against the whole sequence."""
        chunk = self.parallel_context.chunk
        if chunk is not None:
            return chunk.positions(q_len, device), q_len * chunk.count
        return torch.arange(offset, offset + q_len, device=device), offset + q_len

    def _relative(self, positions: torch.Tensor, k_len: int, *, causal: bool,
                  position_ids: torch.Tensor | None = None) -> dict:
        """RoPE angles / ALiBi or T5 biases for self-attention from the queries' positions (keys at 0..k_len-1),
        computed once per stack (causal: the decoder's); RoPE from each row's `position_ids` (B, T) when given."""
        device = positions.device
        extra: dict = {}

        def tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, ...]:
            return rope(positions) if position_ids is None else tuple(t[:, None] for t in rope(position_ids))

        if self.rope is not None:
            extra["rope"] = tables(self.rope)  # (T, D), or (B, 1, T, D) from each row's position_ids
        if self.local_rope is not None:
            extra["local_rope"] = tables(self.local_rope)
        if self.alibi_slopes is not None:
            extra["bias"] = alibi_bias(self.alibi_slopes, positions, torch.arange(k_len, device=device))
        t5_bias = self.decoder_relative_bias if causal else self.encoder_relative_bias
        if t5_bias is not None:
            extra["bias"] = t5_bias(positions, torch.arange(k_len, device=device))
        if causal and self.cfg.uses_mla and self.cfg.mla.query_scale_beta:
            extra["query_scale"] = query_scale(self.cfg, positions if position_ids is None else position_ids)
        return extra

    def _block_inputs(self, block: int, masks: dict[int | None, AttentionMask], extra: dict
                      ) -> tuple[AttentionMask, dict]:
        """(mask, relative-position keywords) of block `block`: its window's mask, and the windowed blocks' own
        RoPE tables where they have them."""
        kwargs = {k: v for k, v in extra.items() if k != "local_rope"}
        if self.cfg.local_rope(block):
            kwargs["rope"] = extra["local_rope"]
        return masks[self.cfg.window(block)], kwargs

    def encode(
        self, ids: torch.Tensor, padding: torch.Tensor | None = None, *, pool: bool = True,
        h: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder hidden states (B, T, D) and their padding mask; pooled for cross-attention if configured.

        h: hidden states from an earlier pipeline stage instead of embedding `ids` (B, T) here.
        """
        length = ids.shape[1]  # not h's: a received h may be a sequence-parallel shard
        positions, k_len = self._positions(length, 0, ids.device)
        h = self._hidden(ids, h, source=True, positions=positions)
        if self.encoder_layers is None:
            raise ValueError(f"a {self.cfg.family} model has no encoder to encode with")
        whole = self.parallel_context.chunk is not None and self.parallel_context.chunk.ulysses  # whole sequences
        masks = {window: build_mask(k_len if whole else length, k_len, q_positions=None if whole else positions,
                                    causal=False, window=window, key_padding=padding,
                                    device=h.device)  # under all-gather cp: each piece takes its rows
                 for window in {self.cfg.window(int(key)) for key in self.encoder_layers}}
        extra = self._relative(positions, k_len, causal=False)
        for key, layer in self.encoder_layers.items():
            mask, kwargs = self._block_inputs(int(key), masks, extra)
            h = layer(h, mask, chunk=self.parallel_context.chunk, **kwargs)
        if self.encoder_merge is not None:
            h = self.encoder_merge(h)
        if self.encoder_norm is not None:
            h = self.encoder_norm(h)
        factor = self.cfg.cross_downsample
        if pool and factor > 1:
            h = masked_avg_pool(h, padding, factor)
            padding = pool_padding_mask(padding, factor) if padding is not None else None
        return h, padding

    def decode(
        self,
        ids: torch.Tensor,
        padding: torch.Tensor | None = None,
        *,
        memory: torch.Tensor | None = None,
        memory_padding: torch.Tensor | None = None,
        cache: list[BlockCache] | None = None,
        h: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        final_norm: bool = True,
        merge: bool = True,
    ) -> torch.Tensor:
        """Causal stack over target ids (B, T); with a cache, ids are only the new tokens.

        h: hidden states from an earlier pipeline stage instead of embedding `ids` here.
        documents: each key position's document id (B, T), for attention within documents only.
        position_ids: each token's position in its row (B, T) for absolute positions and RoPE, e.g. counted from a
            row's first real token under left padding; relative schemes and masks need none (padding shifts a
            row's tokens alike). Default: their place in the sequence.
        final_norm: false leaves out the stack's final norm (multi-token prediction reads the hidden states before it).
        merge: false leaves out the residual's merge too: mHC's streams (B, T, n, D), which its multi-token prediction
            modules read.
        """
        q_len = ids.shape[1]  # not h's: a received h may be a sequence-parallel shard
        # the longest: a block without a token mixer (`none`) keeps an empty cache
        offset = max(c.self_attn.length for c in cache) if cache else 0
        positions, k_len = self._positions(q_len, offset, ids.device)
        h = self._hidden(ids, h, positions=positions if position_ids is None else position_ids)
        for name, keys in (("padding mask", padding), ("doc_ids", documents)):
            if keys is not None and keys.shape[1] != k_len:
                raise ValueError(f"decoder {name} covers {keys.shape[1]} positions, expected {k_len} (cached + new "
                                 "tokens; under context parallel the whole sequence)")
        if self.decoder_layers is None:
            raise ValueError(f"a {self.cfg.family} model has no decoder to decode with")
        windows = {self.cfg.window(int(key)) for key in self.decoder_layers}
        masks, extra = self._causal_inputs(q_len, k_len, offset, positions, windows, padding, documents,
                                           position_ids, h.device)
        memory_mask = None
        if memory is not None:
            memory_mask = build_mask(q_len, memory.shape[1], causal=False, key_padding=memory_padding,
                                     device=h.device)
        carry = Carry()  # what a block hands later blocks of this forward (`TokenMixer.reads_carry`)
        for i, (key, layer) in enumerate(self.decoder_layers.items()):
            mask, kwargs = self._block_inputs(int(key), masks, extra)
            h = layer(h, mask, memory=memory, memory_mask=memory_mask, cache=cache[i] if cache else None,
                      chunk=self.parallel_context.chunk, token_ids=ids, carry=carry, **kwargs)
        if self.decoder_merge is not None:
            if not merge:
                return h
            h = self.decoder_merge(h)
        if self.decoder_norm is not None and final_norm:
            h = self.decoder_norm(h)
        return h

    def _causal_inputs(self, q_len: int, k_len: int, offset: int, positions: torch.Tensor, windows: set[int | None],
                       padding: torch.Tensor | None, documents: torch.Tensor | None,
                       position_ids: torch.Tensor | None, device: torch.device
                       ) -> tuple[dict[int | None, AttentionMask], dict]:
        """The causal masks of `windows` and the relative-position keywords of a causal stack's blocks."""
        masks: dict[int | None, AttentionMask] = {}
        for window in windows:
            if self.parallel_context.chunk is None:
                masks[window] = build_mask(q_len, k_len, q_offset=offset, causal=True, window=window,
                                           key_padding=padding, documents=documents, device=device)
            elif self.parallel_context.chunk.ulysses:  # attention runs on whole sequences (a subset of heads)
                masks[window] = build_mask(k_len, k_len, causal=True, window=window, key_padding=padding,
                                           documents=documents, device=device)
            elif window is None and padding is None and documents is None:
                masks[window] = AttentionMask(None, is_causal=True)  # each piece: causal at the bottom right
            else:  # each piece takes its rows of the mask over the whole sequence
                masks[window] = build_mask(q_len, k_len, q_positions=positions, causal=True, window=window,
                                           key_padding=padding, documents=documents, device=device)
        extra = self._relative(positions, k_len, causal=True, position_ids=position_ids)
        if self.parallel_context.chunk is None:  # this call's tokens' rows, for a mixer that reads no mask
            extra["padding"] = None if padding is None else padding[:, -q_len:]
            extra["documents"] = None if documents is None else documents[:, -q_len:]
        else:  # this rank's pieces' padding; the whole sequence's documents (a piece's state restarts by them)
            extra["padding"] = None if padding is None else padding[:, positions]
            extra["documents"] = documents
        return masks, extra

    def head(self, h: torch.Tensor, labels: torch.Tensor | None = None, head_loss: HeadLoss | None = None
             ) -> torch.Tensor:
        """Logits; or, given `head_loss` and labels, the summed loss straight from the final hidden states."""
        if self.output is None:
            raise ValueError("this pipeline stage holds no output head")
        if self.head_dense is not None and self.head_act is not None and self.head_norm is not None:
            h = self.head_norm(self.head_act(self.head_dense(h)))
        if self.cfg.scale_output:
            h = h * self.cfg.d_model**-0.5
        if head_loss is not None:  # inside forward, so FSDP's hooks see the output weight in use
            if labels is None:
                raise ValueError("a fused head loss needs the labels")
            return head_loss(h, labels, self.output.weight, self.output.bias)
        logits = self.output(h)
        if self.cfg.logit_softcap is not None:
            logits = self.cfg.logit_softcap * torch.tanh(logits / self.cfg.logit_softcap)
        return logits

    def new_cache(self) -> list[BlockCache]:
        return [block.new_cache() for block in (self.decoder_layers or {}).values()]  # type: ignore[operator]

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        *,
        streams: Streams | None = None,
        labels: torch.Tensor | None = None,
        head_loss: HeadLoss | None = None,
        mtp_labels: torch.Tensor | None = None,
        mtp_ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | Streams | tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Logits (B, T, vocab), or with `head_loss` the summed loss against `labels` (no full logits).

        Masks are (B, T) with True (or 1) for real tokens, False for padding. doc_ids (B, T): the packed document
        each token belongs to; with model.attention.document_mask, causal attention stays within documents (ignored
        otherwise).

        decoder-only: input_ids are the (causal) sequence; encoder-only: input_ids are the (bidirectional)
        sequence; encoder-decoder: input_ids are the source, decoder_input_ids the teacher-forced target.
        The pieces present run in order; a model without its head (a pipeline stage) returns the `Streams`
        it reached, and `streams` carries in those of the stage before.

        mtp_labels: the main labels (B, T), to run the multi-token prediction modules too: returns (the main output,
        [(module k's logits or summed loss, its shifted labels) for k = 1 .. model.mtp.depth]).
        mtp_ahead: every module's (input ids, targets), each (B, T, depth) (`model.mtp.ahead_inputs`), computed on
            the whole sequence; needed under context parallel, where this rank holds pieces of it.
        """
        spec = self.spec
        target_ids, target_padding = input_ids, attention_mask
        if spec.seq2seq:
            if decoder_input_ids is None:
                raise ValueError("an encoder-decoder model needs decoder_input_ids (the shifted target)")
            target_ids, target_padding = decoder_input_ids, decoder_attention_mask
        s = streams or Streams()
        unnormed, documents = None, None  # the main stack's output before its final norm, for multi-token prediction
        if self.encoder_layers is not None:
            ends = self._ends_encoder()
            h, _ = self.encode(input_ids, attention_mask, pool=ends, h=s.encoder)
            s = replace(s, encoder=None, memory=h) if ends else replace(s, encoder=h)
        if self.decoder_layers is not None:
            memory_padding = attention_mask if s.memory is not None else None
            if memory_padding is not None and self.cfg.cross_downsample > 1:
                memory_padding = pool_padding_mask(memory_padding, self.cfg.cross_downsample)
            documents = doc_ids if self.cfg.attention.document_mask and not spec.seq2seq else None
            h = self.decode(target_ids, target_padding, memory=s.memory, memory_padding=memory_padding, h=s.decoder,
                            documents=documents, final_norm=mtp_labels is None, merge=mtp_labels is None)
            if mtp_labels is not None:
                unnormed = h  # under mHC its streams
                if self.decoder_merge is not None:
                    h = self.decoder_merge(h)
                h = h if self.decoder_norm is None else self.decoder_norm(h)
            s = replace(s, decoder=h)
        if self.output is None:
            return s
        last = s.decoder if spec.has_decoder else s.memory
        assert last is not None  # a model with its head holds the last stack, which just ran
        main = self.head(last, labels, head_loss)
        if mtp_labels is None:
            return main
        if unnormed is None:
            raise ValueError(f"a {self.cfg.family} model has no decoder stack for multi-token prediction")
        if self.mtp_layers is None:
            raise ValueError("model.mtp.depth is 0: this model has no multi-token prediction modules to run")
        if mtp_ahead is None:
            if self.parallel_context.chunk is not None:
                raise ValueError("under context parallel, multi-token prediction needs mtp_ahead (its ids and targets "
                                 "from the whole sequence, model.mtp.ahead_inputs) computed before the batch is split")
            mtp_ahead = ahead_inputs(target_ids, mtp_labels, len(self.mtp_layers))
        return main, self._multi_token(unnormed, target_ids, target_padding, documents, mtp_ahead, head_loss)

    def _multi_token(self, h: torch.Tensor, ids: torch.Tensor, padding: torch.Tensor | None,
                     documents: torch.Tensor | None, ahead: tuple[torch.Tensor, torch.Tensor],
                     head_loss: HeadLoss | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each MTP module's (logits or summed loss, shifted labels) from the main stack's unnormed output `h` (under
        mHC its unmerged streams)."""
        assert self.mtp_layers is not None
        q_len = ids.shape[1]
        positions, k_len = self._positions(q_len, 0, ids.device)
        kinds, index = block_kinds(self.cfg)  # the modules' block kinds (model.mtp.layer_type, else the last block's)
        window = kinds.window(index)
        masks, extra = self._causal_inputs(q_len, k_len, 0, positions, {window}, padding, documents, None, h.device)
        kwargs = {key: value for key, value in extra.items() if key != "local_rope"}
        if kinds.local_rope(index):
            kwargs["rope"] = extra["local_rope"]
        ahead_ids, ahead_targets = ahead
        outputs = []
        for k, module in enumerate(self.mtp_layers):
            assert isinstance(module, (MtpModule, HyperMtpModule))
            embedded = self.embed(ahead_ids[..., k], positions=positions)
            h, normed = module(h, embedded, masks[window], chunk=self.parallel_context.chunk,
                               token_ids=ahead_ids[..., k], **kwargs)
            targets = ahead_targets[..., k]
            outputs.append((self.head(normed, targets, head_loss), targets))
        return outputs

    def _ends_encoder(self) -> bool:
        """Whether this model (or pipeline stage) holds the encoder's last block."""
        return self.encoder_layers is not None and str(self.spec.depth(self.cfg, "encoder") - 1) in self.encoder_layers


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["AttentionMask", "Transformer", "count_parameters"]
