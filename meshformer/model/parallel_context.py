"""What a model part knows about the parallel layout it runs under, declared once on `Transformer`.

The model runs on one device by default; parallel code (meshformer/parallel/) tells a model or a pipeline stage
about its layout only through `Transformer.set_parallel_context`, and the model hands each block what it needs
as typed arguments. Which stage a part is (`StageSpan`) is given to `Transformer.__init__`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshformer.model.attention import SequenceChunk
from meshformer.model.moe import TokenGroup


@dataclass(frozen=True)
class StageSpan:
    """The layer range of one pipeline stage (encoder layers are 0..E-1, decoder layers E..E+D-1)."""

    index: int
    n_stages: int
    start: int  # first global layer index
    stop: int  # one past the last


@dataclass(frozen=True)
class ParallelContext:
    """The layout facts a model part's forward and buffers depend on; the default is a single device."""

    chunk: SequenceChunk | None = None  # context parallel: which pieces of each sequence this rank holds
    # tensor parallel: the attention heads (so the ALiBi slopes) this rank holds
    alibi_heads: slice = field(default_factory=lambda: slice(None))
    # the ranks holding other tokens of a micro-batch, over which MoE layers add up their balance statistics
    token_group: TokenGroup | None = None
