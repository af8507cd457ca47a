"""The tensor-parallel styles a family or block component may name; parallel/tensor_parallel.py gives each its
DTensor layouts (so `model/` declares them without importing `parallel/`)."""

VOCAB_ROWS = "vocab_rows"  # embedding table split on the vocabulary, output replicated
VOCAB_COLUMNS = "vocab_columns"  # output projection split on the vocabulary, logits stay sharded
SEQUENCE = "sequence"  # runs on this rank's slice of the sequence (norms)
HEADS = "heads"  # runs on this rank's heads of a (B, H, T, D) tensor with a replicated weight (QK-norm)
HEAD_VALUES = "head_values"  # holds one value per attention head, split with the heads (attention sinks)
GATHER = "gather"  # all-gathers its one input from the sequence slices
GATHER_MASKED = "gather_masked"  # all-gathers its first input; the second (the mask) passes untouched
GATHER_MEMORY = "gather_memory"  # as GATHER_MASKED, and reads the (replicated) encoder memory keyword
COLWISE = "colwise"  # splits output features: whole heads, or a slice of d_ff
ROWWISE = "rowwise"  # splits input features; the output is reduce-scattered onto the sequence
# an identity the mixer routes a replicated tensor through, which this rank's heads alone read: its gradient is
# partial and is summed over the ranks (MLA's rotary key, shared by every head)
PARTIAL_GRADIENT = "partial_gradient"
# a module that takes its heads' share of its own parameters through its `shard_heads(ranks, rank, sum_gradient)`
# (Gated DeltaNet), its first input all-gathered from the sequence slices; a `sum_heads` attribute it has gets the
# forward sum over the ranks (V4 attention's indexer loss target: every head's mass)
HEAD_SHARD = "head_shard"
# a module of this rank's sequence slice that reads the (whole, replicated) `token_ids` keyword: sliced alike (hash
# routing)
TOKEN_IDS = "token_ids"
TOKENS = "tokens"  # runs on this rank's tokens flattened to (N, D) with a replicated weight (the MoE router)

# a module of this rank's tokens whose own (replicated) parameters it reads through its `read_parameter`, which
# sums their gradients over the ranks (mHC's branch joins and merge: each rank's tokens give their share)
TOKEN_SHARE = "token_share"
