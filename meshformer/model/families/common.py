"""What the three built-in families share: the blocks of `model/layers.py` and the pieces of `Transformer`.

A family built from other blocks (e.g. mixture-of-experts feed-forwards) declares its own tensor-parallel rules
and stage pieces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshformer.model.families.spec import (
    COLWISE,
    GATHER,
    GATHER_MASKED,
    GATHER_MEMORY,
    HEAD_VALUES,
    HEADS,
    ROWWISE,
    SEQUENCE,
    TOKENS,
    VOCAB_COLUMNS,
    VOCAB_ROWS,
    FamilySpec,
    StagePieces,
    TensorParallelRules,
)

if TYPE_CHECKING:
    from meshformer.model.transformer import Transformer

# No stage holds the T5 relative biases (shared by a whole stack): meshformer/parallel_dims.py refuses
# t5_relative with pp > 1.
STAGE_PIECES = StagePieces(
    first=("tok_embeddings", "src_embeddings", "pos_embeddings", "embedding_norm"),
    every=("rope", "local_rope"),
    last=("head_dense", "head_act", "head_norm", "output"),
)


def _attention(prefix: str) -> dict[str, str]:
    # Colwise q/k/v shard whole heads (rows are head-major), so the attention module infers its local
    # head count from the shapes; GQA works whenever tp divides n_kv_heads. QK-norm weights are per head
    # dimension, replicated; their gradients sum over the heads of every rank. Attention sinks: one per head, split.
    # Multi-head latent attention (model/mla.py): the up-projections split by heads; the down-projections and their
    # norms stay replicated (full gradients: the split linears sum their input gradients over the ranks).
    return {f"{prefix}.q_proj": COLWISE, f"{prefix}.k_proj": COLWISE, f"{prefix}.v_proj": COLWISE,
            f"{prefix}.o_proj": ROWWISE, f"{prefix}.q_norm": HEADS, f"{prefix}.k_norm": HEADS,
            f"{prefix}.sinks": HEAD_VALUES, f"{prefix}.q_b_proj": COLWISE, f"{prefix}.kv_b_proj": COLWISE}


# Between blocks the residual stream is a sequence shard; attention and feed-forward gather it on entry and
# reduce-scatter it on exit. Norm outputs stay local tensors: with post-norm they are the residual stream.
TP_RULES = TensorParallelRules(
    top={"tok_embeddings": VOCAB_ROWS, "src_embeddings": VOCAB_ROWS, "output": VOCAB_COLUMNS},
    block={
        # the sandwich's output norms see the reduce-scattered sub-layer output, a sequence shard
        "attn_norm": SEQUENCE, "attn": GATHER_MASKED, **_attention("attn"), "attn_out_norm": SEQUENCE,
        # Encoder memory arrives replicated; as one DTensor its gradient is all-reduced once for k and v.
        "cross_norm": SEQUENCE, "cross_attn": GATHER_MEMORY, **_attention("cross_attn"), "cross_out_norm": SEQUENCE,
        "ffn_norm": SEQUENCE, "ffn": GATHER, "ffn_out_norm": SEQUENCE,
        "ffn.gate_proj": COLWISE, "ffn.up_proj": COLWISE, "ffn.down_proj": ROWWISE,  # SwiGLU splits gate as up
    },
    # An MoE feed-forward stays sequence parallel: each rank routes its own tokens and expert parallelism spans the
    # tensor-parallel ranks; the router and shared experts hold replicated weights whose gradients sum over ranks.
    moe_block={"ffn.router": TOKENS, **{f"ffn.shared_experts.{name}": SEQUENCE
                                        for name in ("gate_proj", "up_proj", "down_proj")}},
)


def init_transformer(model: Transformer) -> None:
    """The model's own initialisation (model/transformer.py: Transformer.init_weights)."""
    model.init_weights()


def transformer_family(**fields: Any) -> FamilySpec:
    """A family of `model/layers.py` blocks: the shared init, stage pieces and TP rules, unless overridden."""
    return FamilySpec(**{"init": init_transformer, "pipeline": STAGE_PIECES, "tp_rules": TP_RULES, **fields})
