"""Pipeline stages of a Transformer: split by layers, encoder layers first, then decoder layers.

A stage is a `TransformerStage`: a Transformer built by its own `__init__` for the stage's `StageSpan`, so it
holds only its pieces (the others are None) under the same attribute names, and then copies of the model's
values. Parameter names match the plain model for checkpoints and parity checks (a copy of a tied weight is
named by `Transformer.canonical_name`), and the model's own `forward` runs whatever the stage holds. Which
pieces exist and where they go is the family spec's `pipeline` layout; this module adds only the packing of
the streams between stages.

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

With a fused head loss (train.loss chunked/liger) the last stage computes the loss itself, from its final
hidden states and the batch's `labels` (a keyword like the model inputs), and returns the summed token loss
instead of logits: the output projection runs inside the stage's forward, where FSDP's unshard/reshard hooks
and tensor parallelism's vocabulary sharding apply exactly as without pipelining.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from meshformer.config import Config
from meshformer.loss.cross_entropy import cross_entropy_sum
from meshformer.loss.fused import HeadLoss
from meshformer.loss.objective import Loss
from meshformer.model import Transformer
from meshformer.model.parallel_context import StageSpan
from meshformer.model.transformer import PIECES, Streams, stage_holdings
from meshformer.parallel_dims import ParallelDims, stages_per_rank, total_layers


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


@dataclass(frozen=True)
class StagePlacement:
    """Which layers each pipeline stage holds and which pipeline rank runs it."""

    spans: list[StageSpan]  # indexed by stage id
    stage_to_rank: dict[int, int]

    def ids_for_rank(self, pp_rank: int) -> list[int]:
        """The stages `pp_rank` holds, in ascending order (the order its schedule runs them)."""
        return sorted(s for s, r in self.stage_to_rank.items() if r == pp_rank)


def stage_placement(cfg: Config, dims: ParallelDims) -> StagePlacement:
    """The layer split and stage-to-rank placement of `cfg.parallel` (one stage on one rank without pipelining)."""
    spr = stages_per_rank(cfg) if dims.pp > 1 else 1
    spans = split_layers(total_layers(cfg), dims.pp * spr, cfg.parallel.pp_split_points or None)
    v_shape = dims.pp > 1 and cfg.parallel.pp_schedule == "zbv"
    stage_to_rank = {s: r for r in range(dims.pp) for s in stage_ids_for_rank(r, dims.pp, spr, v_shape)}
    return StagePlacement(spans, stage_to_rank)


def stage_pieces(model: Transformer, span: StageSpan) -> dict[str, nn.Module | None]:
    """The modules (shared with `model`, not copied) that the stage covering `span` needs."""
    held, blocks = stage_holdings(model.spec, model.cfg, span)
    pieces: dict[str, nn.Module | None] = dict.fromkeys(PIECES)
    for name in held:
        piece = getattr(model, name)
        pieces[name] = nn.ModuleDict({k: piece[k] for k in blocks[name]}) if name in blocks else piece
    return pieces


class TransformerStage(Transformer):
    """One pipeline stage: a Transformer that holds only the pieces of its layer range."""

    span: StageSpan  # always set: Transformer.__init__ is given one

    def __init__(self, model: Transformer, span: StageSpan) -> None:
        with torch.device("meta"):  # the pieces built here only stand in for the copies of the model's below
            super().__init__(model.cfg, init_seed=model.init_seed, span=span)
        self.hold_copies_of(model)
        self.is_last = span.index == span.n_stages - 1
        # The last stage's objective (set by the pipelined model): with a fused head loss the stage returns the
        # summed loss, else logits (and the token loss sums multi-token prediction's modules). None: not last.
        self.loss: Loss | None = None

    @property
    def head_loss(self) -> HeadLoss | None:
        """The fused head loss the last stage computes (None: it returns logits)."""
        return self.loss.head_loss if self.loss is not None else None

    @head_loss.setter
    def head_loss(self, value: HeadLoss | None) -> None:
        base = self.loss if self.loss is not None else Loss(cross_entropy_sum)
        self.loss = base.with_token_loss(base.logits_loss, value)

    def forward(  # type: ignore[override]  # a stage takes the previous stage's tensors positionally
        self, *stream: torch.Tensor, labels: torch.Tensor | None = None, mtp_ahead_ids: torch.Tensor | None = None,
        mtp_ahead_labels: torch.Tensor | None = None, loss: Loss | None = None, **batch: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Received tensors in, tensors to send out; the batch's model inputs (`Transformer.forward`'s
        arguments) arrive as keywords. The last stage returns logits, or with `head_loss` the summed loss
        against `labels` (which the other stages ignore). In training with multi-token prediction (the modules'
        ids and targets given) it returns the summed losses (main, module 1, ...) as one vector."""
        streams = self._unpack(stream, batch.get("decoder_input_ids"))
        loss = loss or self.loss  # `loss`: another objective than the training one (evaluation)
        head_loss = loss.head_loss if self.is_last and loss is not None else None
        ahead = None
        if self.is_last and mtp_ahead_ids is not None and mtp_ahead_labels is not None:
            ahead = (mtp_ahead_ids, mtp_ahead_labels)
        out = super().forward(**batch, streams=streams,  # type: ignore[arg-type]  # batch: model-input tensors
                              labels=labels if head_loss is not None or ahead is not None else None,
                              head_loss=head_loss,
                              mtp_labels=labels if ahead is not None else None, mtp_ahead=ahead)
        if isinstance(out, tuple):
            assert labels is not None
            assert loss is not None  # the pipelined model gives the last stage its objective
            main, sums = loss.mtp_sums(out, labels)
            return torch.cat([main.reshape(1), sums])
        return out if isinstance(out, torch.Tensor) else self._pack(out, stream)

    def _unpack(self, stream: tuple[torch.Tensor, ...], target_ids: torch.Tensor | None) -> Streams:
        """The received tensors as `Streams` (see the module docstring for what travels)."""
        if not self.spec.seq2seq:
            if not stream:
                return Streams()
            return Streams(decoder=stream[0]) if self.decoder_layers is not None else Streams(encoder=stream[0])
        if not stream:
            if target_ids is None:
                raise ValueError("an encoder-decoder pipeline stage needs decoder_input_ids (the shifted target)")
            return Streams(decoder=self.embed(target_ids))
        if self.encoder_layers is not None:
            return Streams(encoder=stream[0], decoder=stream[1])
        return Streams(decoder=stream[0], memory=stream[1])

    def _pack(self, streams: Streams, received: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not self.spec.seq2seq:
            return next(h for h in (streams.decoder, streams.encoder, streams.memory) if h is not None)
        out = (streams.encoder, streams.decoder) if streams.encoder is not None else (streams.decoder, streams.memory)
        # Received tensors passed on unchanged are sent as copies: zero-bubble schedules detach stage outputs in
        # place, and a copy's backward hands the next stage's gradient back to this stage's input.
        passed_on = {id(t) for t in received}
        assert all(t is not None for t in out)  # an encoder-decoder stage always carries two streams
        return tuple(t.clone() if id(t) in passed_on else t for t in out if t is not None)
