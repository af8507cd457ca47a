"""The training loss as one value: which loss, with which options, and the functions that compute it on this rank.

`meshformer.train.loss_choice.resolve_loss` turns the configuration into a `LossSpec` once; `parallelize` binds it to
this rank's vocabulary shard (tensor parallel) once the mesh exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from meshformer.errors import ConfigError
from meshformer.loss.cross_entropy import LossFn, plain_loss_fn
from meshformer.loss.fused import HeadLoss, VocabShard, head_loss_fn
from meshformer.loss.vocab_parallel import vocab_parallel_loss_fn
from meshformer.renamed import renamed_attribute, renamed_names

LossMethod = Literal["plain", "chunked", "chunked_recompute", "liger"]  # train.loss with "auto" resolved


@dataclass(frozen=True)
class BoundLoss:
    """The loss of one rank: `head_loss` computes it from the final hidden states (None: the model returns
    logits and `logits_loss` computes it from them)."""

    logits_loss: LossFn
    head_loss: HeadLoss | None


@dataclass(frozen=True)
class LossSpec:
    """method: "plain" (full logits) or a fused head loss (train.loss with "auto" resolved).

    custom: a caller's loss on full-vocabulary logits, used as given instead of cross-entropy (method "plain").
    """

    method: LossMethod
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    chunk_rows: int | None = None  # rows per chunk of a fused head loss; None: `default_chunk_rows`
    custom: LossFn | None = None

    def bind(self, shard: VocabShard | None) -> BoundLoss:
        """The loss on this rank; `shard`: this rank's vocabulary rows under tensor parallel (None: all of them)."""
        if self.custom is not None:
            if shard is not None:
                raise ConfigError("a custom loss_fn takes full-vocabulary logits, but tensor parallel "
                                  "(parallel.tp > 1) shards the logits over ranks",
                                  "use parallel.tp=1 for a custom loss, or the built-in one (train.loss, "
                                  "train.label_smoothing, train.z_loss)")
            return BoundLoss(self.custom, None)
        if shard is None:
            logits_loss = plain_loss_fn(self.label_smoothing, self.z_loss)
        else:
            logits_loss = vocab_parallel_loss_fn(shard, self.label_smoothing, self.z_loss)
        head_loss = None if self.method == "plain" else head_loss_fn(self.method, self.label_smoothing, self.z_loss,
                                                                      shard, self.chunk_rows)
        return BoundLoss(logits_loss, head_loss)


renamed_attribute(LossSpec, "kind", "method")
if not TYPE_CHECKING:
    __getattr__ = renamed_names(__name__, {"LossKind": "LossMethod"})
