"""What the three built-in families share: the blocks of `model/layers.py` and the pieces of `Transformer`.

A family built from other blocks declares its own tensor-parallel rules and stage pieces; the mixers inside a block
declare theirs (model/components/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshformer.model.families.spec import FamilySpec, StagePieces, TensorParallelRules
from meshformer.model.tp_styles import SEQUENCE, VOCAB_COLUMNS, VOCAB_ROWS

if TYPE_CHECKING:
    from meshformer.model.transformer import Transformer

# No stage holds the T5 relative biases (shared by a whole stack): meshformer/parallel_dims.py refuses
# t5_relative with pp > 1.
STAGE_PIECES = StagePieces(
    first=("tok_embeddings", "src_embeddings", "pos_embeddings", "embedding_norm"),
    every=("rope", "local_rope"),
    last=("head_dense", "head_act", "head_norm", "output"),
)


# Between blocks the residual stream is a sequence shard; each mixer gathers it on entry and reduce-scatters it on
# exit (its own rules: model/components/). Norm outputs stay local tensors: with post-norm they are the residual
# stream; the sandwich's output norms see the reduce-scattered sub-layer output, a sequence shard.
TP_RULES = TensorParallelRules(
    top={"tok_embeddings": VOCAB_ROWS, "src_embeddings": VOCAB_ROWS, "output": VOCAB_COLUMNS},
    block={name: SEQUENCE for name in ("attn_norm", "attn_out_norm", "cross_norm", "cross_out_norm", "ffn_norm",
                                       "ffn_out_norm")},
)


def init_transformer(model: Transformer) -> None:
    """The model's own initialisation (model/transformer.py: Transformer.init_weights)."""
    model.init_weights()


def transformer_family(**fields: Any) -> FamilySpec:
    """A family of `model/layers.py` blocks: the shared init, stage pieces and TP rules, unless overridden."""
    return FamilySpec(**{"init": init_transformer, "pipeline": STAGE_PIECES, "tp_rules": TP_RULES, **fields})
