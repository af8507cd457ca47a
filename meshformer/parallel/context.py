"""Context parallel: each sequence split over the `cp` ranks of the cp mesh dimension.

The sequence is cut into 2 x cp equal pieces and rank r holds pieces r and 2cp - 1 - r: under causal attention
an early piece sees few keys and a late one many, so every rank does the same attention work (contiguous chunks
would give rank r (2r + 1) / cp of the mean). Every layer works on this rank's tokens; only attention needs the
others: each self-attention layer all-gathers the pieces' keys and values (after RoPE, so every key keeps its own
position), puts them in sequence order, and attends from each piece's queries to every key up to that piece's
end, causally aligned at the bottom right (an encoder's pieces: to every key; `model.attention.SequenceChunk`).
A linear_attention block instead passes its recurrent state and convolution window from piece to piece in
sequence order (model/linear_attention.py).
A padding mask is not split: it masks keys, and every rank reads the whole sequence's keys. This is the
all-gather flavour of context parallelism (Llama 3's choice for long context: with grouped-query attention K/V
are a fraction of the activations); its backward reduce-scatters the K/V gradients back to their owners.
With parallel.cp_method = "ulysses" the token mixers instead exchange sequence pieces for head shards all-to-all
(`SequenceChunk.to_heads` / `to_sequence`): each rank runs whole sequences of 1/cp of its heads, with the mask over
the whole sequence, and no state passes between ranks.
Parameters are replicated over cp, so FSDP shards them over dp_shard x cp and its reduce-scatter sums the pieces'
gradients.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from meshformer.batch import Batch
from meshformer.model.attention import SequenceChunk
from meshformer.model.components import TOKEN_MIXER
from meshformer.model.mtp import ahead_inputs
from meshformer.model.transformer import Transformer

# The differentiable all-gather (its backward reduce-scatters, summing); torch 2.13 renamed it, earlier releases
# have only the old name.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def apply_context_parallel(model: Transformer, cp_mesh: DeviceMesh, method: str = "allgather") -> int:
    """Give the model (or pipeline stage) this rank's `SequenceChunk`, which it hands its self-attention layers;
    returns the number of layers that exchange across the pieces (attention gathers keys and values,
    linear_attention passes its recurrent state on; under Ulysses each mixer's all-to-alls)."""
    group = cp_mesh.get_group()
    size = cp_mesh.size()

    def exchange(t: torch.Tensor) -> torch.Tensor:
        """Slice r of dim 0 to rank r, differentiably (the backward is the reverse all-to-all)."""
        return funcol.all_to_all_single_autograd(t, [t.shape[0] // size] * size, [t.shape[0] // size] * size,
                                                 group)

    chunk = SequenceChunk(cp_mesh.get_local_rank(), size, lambda t: _all_gather(t, gather_dim=2, group=group),
                          exchange if method == "ulysses" else None)
    model.set_parallel_context(replace(model.parallel_context, chunk=chunk))
    # each block's token mixer gathers; a cross-attending stack's reading of the memory does not (refused under cp)
    return sum(1 for module in model.modules() if TOKEN_MIXER in getattr(module, "mixers", {}))


def sequence_chunk(batch: Batch, index: int, count: int) -> Batch:
    """This rank's two pieces of every per-token tensor in the batch (all of them are (B, T, ...)); a padding mask and
    the document ids stay whole: they describe keys, and every rank's attention reads the whole sequence's keys."""
    length, pieces = batch["input_ids"].shape[1], 2 * count
    if length % pieces:
        raise ValueError(f"parallel.cp={count} cuts each sequence into {pieces} equal pieces, but this batch's "
                         f"length is {length}; set data.seq_len to a multiple of 2 x cp")

    def mine(value: torch.Tensor) -> torch.Tensor:
        parts = value.chunk(pieces, dim=1)
        return torch.cat([parts[index], parts[pieces - 1 - index]], dim=1)

    return {key: value if key in ("attention_mask", "doc_ids") else mine(value) for key, value in batch.items()}


def with_ahead_inputs(batch: Batch, depth: int) -> Batch:
    """The batch with every multi-token prediction module's input ids and targets (`mtp_ahead_ids`,
    `mtp_ahead_labels`, (B, T, depth)) from its whole sequences: the token k ahead of a piece's last ones lies in
    another piece, and a target's document boundary or padding may too. `sequence_chunk` then splits them like the
    ids."""
    ids, labels = ahead_inputs(batch["input_ids"], batch["labels"], depth)
    return {**batch, "mtp_ahead_ids": ids, "mtp_ahead_labels": labels}
