"""Context parallel: each sequence split into `cp` contiguous chunks, one per rank of the cp mesh dimension.

Every layer works on this rank's chunk of tokens; only attention needs the others: each self-attention layer
all-gathers the chunks' keys and values (after RoPE, so every key keeps its own position) and attends from its
queries to every key up to its chunk's end, causally aligned at the bottom right. This is the all-gather flavour
of context parallelism (Llama 3's choice for long context: with grouped-query attention K/V are a fraction of
the activations); its backward reduce-scatters the K/V gradients back to the chunks' owners. Parameters are
replicated over cp, so FSDP shards them over dp_shard x cp and its reduce-scatter sums the chunks' gradients.

Chunks are contiguous, so with causal attention rank r does (2r + 1) / cp of the mean attention work (the
projections and MLPs, most of the FLOPs at moderate length, are balanced).
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshformer.batch import Batch
from meshformer.model.attention import Attention, SequenceChunk
from meshformer.model.transformer import Transformer

# The differentiable all-gather (its backward reduce-scatters, summing); torch 2.13 renamed it, the GPU machine's
# torch 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> int:
    """Give the model and each of its self-attention layers this rank's `SequenceChunk`; returns the number of
    layers that gather keys and values."""
    group = cp_mesh.get_group()
    chunk = SequenceChunk(cp_mesh.get_local_rank(), cp_mesh.size(),
                          lambda t: _all_gather(t.contiguous(), gather_dim=2, group=group))
    layers = 0
    for module in model.modules():
        if isinstance(module, Transformer):
            module.chunk = chunk
        elif isinstance(module, Attention) and not module.cross:
            module.chunk = chunk
            layers += 1
    return layers


def sequence_chunk(batch: Batch, index: int, count: int) -> Batch:
    """This rank's contiguous chunk of every per-token tensor in the batch (all of them are (B, T, ...))."""
    if "attention_mask" in batch:
        raise ValueError(f"parallel.cp={count}: context parallel runs unpadded (packed) causal batches, but this "
                         "batch has an attention_mask; pack the data (the causal objective does) or set parallel.cp=1")
    length = batch["input_ids"].shape[1]
    if length % count:
        raise ValueError(f"parallel.cp={count} splits each sequence into {count} equal chunks, but this batch's "
                         f"length is {length}; set data.seq_len to a multiple of cp")
    return {key: value.chunk(count, dim=1)[index].contiguous() for key, value in batch.items()}
